"""Edit scripts: which token spans of a cached prefix to drop, the rest repositioned.

An edit script is data, so that it can be hashed into the key of the edited prefix
(:mod:`tenantkv.editing.lineage`) and replayed on another node: two callers that apply the same
script to the same prefix address the same edited cache.

Semantics (AKV's ``drop`` then ``repos``): the tokens of every dropped span leave the cache; every
retained token moves to the position it has in the retained sequence, so positions are
contiguous again. A retained token at position ``p`` moves by ``-d(p)``, where ``d(p)`` is the
number of dropped tokens before ``p``; tokens before the first dropped span do not move.

Canonical bytes (hashed)::

    b"tkv-edit:drop+repos:v1" | u32be N | N x (u32be start | u32be stop)

with spans sorted, disjoint and not adjacent (adjacent spans are merged when the script is made),
so equal edits have equal bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..errors import InvalidRequestError

_TAG = b"tkv-edit:drop+repos:v1"
_SPAN = struct.Struct(">II")
_MAX_POSITION = 2**32 - 1


def _check_span(span: object) -> tuple[int, int]:
    if not isinstance(span, Sequence) or isinstance(span, str | bytes) or len(span) != 2:
        raise InvalidRequestError(f"a dropped span is a (start, stop) pair, got {span!r}")
    start, stop = span
    for value in (start, stop):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequestError(f"span bounds must be integers, got {span!r}")
    if not 0 <= start < stop <= _MAX_POSITION:
        raise InvalidRequestError(f"a dropped span needs 0 <= start < stop, got {span!r}")
    return start, stop


@dataclass(frozen=True)
class EditScript:
    """Drop the token spans ``drops`` (``[start, stop)`` positions of the prefix), then
    reposition the retained tokens contiguously. Build with :meth:`dropping`."""

    drops: tuple[tuple[int, int], ...]

    @classmethod
    def dropping(cls, spans: Iterable[Sequence[int]]) -> EditScript:
        """A script dropping ``spans`` (any order; overlapping or adjacent spans merge)."""
        merged: list[tuple[int, int]] = []
        for start, stop in sorted(_check_span(span) for span in spans):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
            else:
                merged.append((start, stop))
        return cls(tuple(merged))

    def __post_init__(self) -> None:
        previous_stop = -1
        for span in self.drops:
            start, stop = _check_span(span)
            if start <= previous_stop:
                raise InvalidRequestError(
                    "dropped spans must be sorted, disjoint and not adjacent; build scripts with "
                    "EditScript.dropping()"
                )
            previous_stop = stop

    @property
    def is_empty(self) -> bool:
        return not self.drops

    def dropped_tokens(self, length: int | None = None) -> int:
        """Tokens the script drops (of a prefix of ``length`` tokens, when given)."""
        spans = self.drops if length is None else self.within(length).drops
        return sum(stop - start for start, stop in spans)

    def within(self, length: int) -> EditScript:
        """This script cut to the first ``length`` positions (the part that edits a cached
        prefix of that length; the rest only removes tokens not yet computed)."""
        spans = [(start, min(stop, length)) for start, stop in self.drops if start < length]
        return EditScript(tuple(spans))

    def kept_positions(self, length: int) -> torch.Tensor:
        """Old positions of the tokens kept out of ``length`` (int64, ascending)."""
        keep = torch.ones(length, dtype=torch.bool)
        for start, stop in self.within(length).drops:
            keep[start:stop] = False
        return torch.nonzero(keep).flatten()

    def shifts(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kept, delta)``: old positions of the kept tokens and how far each moves (<= 0)."""
        kept = self.kept_positions(length)
        new_positions = torch.arange(len(kept), dtype=torch.int64)
        return kept, new_positions - kept

    def apply_to_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The retained tokens of a 1-D token tensor (what the model sees after the edit)."""
        if tokens.dim() != 1:
            raise InvalidRequestError("apply_to_tokens takes a 1-D tensor of token ids")
        return tokens[self.kept_positions(len(tokens)).to(tokens.device)]

    def canonical_bytes(self) -> bytes:
        """The script as hashed into an edited prefix's key (see the module docstring)."""
        parts = [_TAG, struct.pack(">I", len(self.drops))]
        parts.extend(_SPAN.pack(start, stop) for start, stop in self.drops)
        return b"".join(parts)
