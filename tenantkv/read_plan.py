"""Read plans: which byte ranges of which extents make up a cached prefix, per layer.

A plan groups the prefix's blocks into *runs*: consecutive prefix positions that lie in
consecutive slots of one extent. Loading layer ``l`` is then one range read per run (for a prefix
stored by one call, one read per layer in all).
"""

from __future__ import annotations

from dataclasses import dataclass

from .crypto import ExtentCipher
from .extent_format import ExtentGeometry
from .prefix import BlockKey


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
    blocks: list[tuple[BlockKey, PlannedExtent, int]],
) -> ReadPlan:
    """Build a plan from ``(block key, extent, slot)`` for prefix positions 0, 1, 2, ..."""
    runs: list[Run] = []
    start = 0
    while start < len(blocks):
        _, extent, first_slot = blocks[start]
        end = start + 1
        while (
            end < len(blocks)
            and blocks[end][1].extent_id == extent.extent_id
            and blocks[end][2] == first_slot + (end - start)
        ):
            end += 1
        keys = tuple(key for key, _, _ in blocks[start:end])
        runs.append(Run(extent, first_slot, start, keys))
        start = end
    return ReadPlan(tuple(runs), len(blocks))
