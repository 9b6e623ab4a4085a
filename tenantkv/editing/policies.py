"""Edit policies: which spans of an agent's transcript to drop from its cached prefix.

A policy reads the transcript as segments with token spans (system, user, assistant, tool
call, tool output) and returns an :class:`~tenantkv.editing.script.EditScript`. Policies are
pluggable: anything with a ``script(transcript)`` method is one (:class:`EditPolicy`).

:class:`DropOldToolOutputs` is AKV's "drop old tool outputs": tool outputs of turns older than
the last ``keep_turns`` leave the cache (the text stays with the agent), the rest is
repositioned. A turn starts at each user segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from ..errors import InvalidRequestError
from .script import EditScript

SegmentRole = Literal["system", "user", "assistant", "tool_call", "tool_output"]
SEGMENT_ROLES: tuple[SegmentRole, ...] = (
    "system",
    "user",
    "assistant",
    "tool_call",
    "tool_output",
)


@dataclass(frozen=True)
class Segment:
    """One part of a transcript: its role and its tokens' positions ``[start, stop)``."""

    role: SegmentRole
    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.role not in SEGMENT_ROLES:
            raise InvalidRequestError(
                f"segment role must be one of {', '.join(SEGMENT_ROLES)}, got {self.role!r}"
            )
        if not 0 <= self.start <= self.stop:
            raise InvalidRequestError(f"a segment needs 0 <= start <= stop, got {self}")

    @property
    def length(self) -> int:
        return self.stop - self.start


def check_transcript(transcript: Sequence[Segment]) -> None:
    """Segments must tile the transcript from position 0, in order, without gaps."""
    position = 0
    for segment in transcript:
        if not isinstance(segment, Segment):
            raise InvalidRequestError(f"a transcript holds Segments, got {type(segment).__name__}")
        if segment.start != position:
            raise InvalidRequestError(
                f"segments must follow each other from position 0; one starts at "
                f"{segment.start}, expected {position}"
            )
        position = segment.stop


def turn_numbers(transcript: Sequence[Segment]) -> list[int]:
    """The turn of each segment: 0 before the first user segment, +1 at each user segment."""
    turn = 0
    numbers = []
    for segment in transcript:
        if segment.role == "user":
            turn += 1
        numbers.append(turn)
    return numbers


@runtime_checkable
class EditPolicy(Protocol):
    """Turns a transcript into the edit script to apply to its cached prefix."""

    def script(self, transcript: Sequence[Segment]) -> EditScript: ...


@dataclass(frozen=True)
class DropOldToolOutputs:
    """Drop the tool outputs of every turn but the last ``keep_turns``."""

    keep_turns: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.keep_turns, bool) or not isinstance(self.keep_turns, int):
            raise InvalidRequestError("keep_turns must be an integer")
        if self.keep_turns < 0:
            raise InvalidRequestError(f"keep_turns must be >= 0, got {self.keep_turns}")

    def script(self, transcript: Sequence[Segment]) -> EditScript:
        check_transcript(transcript)
        turns = turn_numbers(transcript)
        last = max(turns, default=0)
        oldest_kept = last - self.keep_turns + 1
        return EditScript.dropping(
            (segment.start, segment.stop)
            for segment, turn in zip(transcript, turns, strict=True)
            if segment.role == "tool_output" and turn < oldest_kept and segment.length
        )


@dataclass(frozen=True)
class KeepEverything:
    """The policy that edits nothing (a baseline, and the default of an agent session)."""

    def script(self, transcript: Sequence[Segment]) -> EditScript:
        check_transcript(transcript)
        return EditScript(())
