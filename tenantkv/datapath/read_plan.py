"""Read plans: which byte ranges of which extents make up a cached prefix, per layer.

A plan groups the prefix's blocks into *runs*: consecutive prefix positions that lie in
consecutive slots of one extent. Loading layer ``l`` is then one range read per run (for a prefix
stored by one call, one read per layer in all).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..crypto import ExtentCipher
from ..prefix import BlockKey
from .extent_format import ExtentGeometry


@dataclass(frozen=True, slots=True)
class PlannedExtent:
    extent_id: str
    geometry: ExtentGeometry
    cipher: ExtentCipher
    #: The data-key version it is sealed with (a load stops if that version is retired).
    key_version: int = 0


@dataclass(frozen=True, slots=True)
class Run:
    extent: PlannedExtent
    first_slot: int
    first_position: int
    block_keys: tuple[BlockKey, ...]

    @property
    def count(self) -> int:
        return len(self.block_keys)


@dataclass(frozen=True, slots=True)
class ReadPlan:
    runs: tuple[Run, ...]
    num_blocks: int

    @property
    def extents(self) -> list[PlannedExtent]:
        seen: dict[str, PlannedExtent] = {}
        for run in self.runs:
            seen.setdefault(run.extent.extent_id, run.extent)
        return list(seen.values())

    @property
    def largest_run_bytes(self) -> int:
        return max((r.count * r.extent.geometry.sealed_bytes for r in self.runs), default=0)


def group_runs(
    keys: Sequence[BlockKey],
    located: Mapping[bytes, tuple[str, int]],
    extents: Mapping[str, PlannedExtent],
) -> ReadPlan:
    """The plan of prefix positions 0, 1, 2, ...: block ``keys[p]`` lies at ``located[key]``
    (extent id, slot), in one of ``extents``.

    One pass over the keys, with no intermediate list: a 128K-token prefix has 2,048 blocks
    and every load waits on its plan."""
    runs: list[Run] = []
    start = 0
    run_extent = ""  # no extent id is empty: position 0 starts the first run
    run_slot = 0
    for position, key in enumerate(keys):
        extent_id, slot = located[key]
        if extent_id == run_extent and slot == run_slot + (position - start):
            continue
        if position:
            runs.append(Run(extents[run_extent], run_slot, start, tuple(keys[start:position])))
        run_extent, run_slot, start = extent_id, slot, position
    if keys:
        runs.append(Run(extents[run_extent], run_slot, start, tuple(keys[start:])))
    return ReadPlan(tuple(runs), len(keys))
