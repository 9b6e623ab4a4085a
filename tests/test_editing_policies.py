"""Edit policies: the drop-old-tool-outputs policy on transcripts of segments, and pluggability."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tenantkv import InvalidRequestError
from tenantkv.editing import DropOldToolOutputs, EditPolicy, EditScript, KeepEverything, Segment


def _transcript(turns: int, tool_tokens: int = 50) -> list[Segment]:
    """system, then per turn: user, tool call, tool output, assistant."""
    segments = [Segment("system", 0, 20)]
    position = 20
    for _ in range(turns):
        for role, length in (
            ("user", 10),
            ("tool_call", 8),
            ("tool_output", tool_tokens),
            ("assistant", 12),
        ):
            segments.append(Segment(role, position, position + length))  # type: ignore[arg-type]
            position += length
    return segments


def test_tool_outputs_older_than_the_last_k_turns_are_dropped() -> None:
    transcript = _transcript(4)
    outputs = [(s.start, s.stop) for s in transcript if s.role == "tool_output"]
    assert DropOldToolOutputs(keep_turns=1).script(transcript).drops == tuple(outputs[:3])
    assert DropOldToolOutputs(keep_turns=2).script(transcript).drops == tuple(outputs[:2])
    assert DropOldToolOutputs(keep_turns=4).script(transcript).is_empty
    assert DropOldToolOutputs(keep_turns=0).script(transcript).drops == tuple(outputs)
    # Nothing but tool outputs is dropped.
    script = DropOldToolOutputs(keep_turns=1).script(transcript)
    assert script.dropped_tokens() == 3 * 50


def test_policies_are_pluggable() -> None:
    class DropEverySystemPrompt:
        def script(self, transcript: Sequence[Segment]) -> EditScript:
            return EditScript.dropping((s.start, s.stop) for s in transcript if s.role == "system")

    for policy in (DropOldToolOutputs(), KeepEverything(), DropEverySystemPrompt()):
        assert isinstance(policy, EditPolicy)
    assert DropEverySystemPrompt().script(_transcript(1)).drops == ((0, 20),)
    assert KeepEverything().script(_transcript(3)).is_empty


def test_bad_transcripts_and_settings_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="role"):
        Segment("tool", 0, 3)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        Segment("user", 5, 3)
    with pytest.raises(InvalidRequestError, match="follow each other"):
        DropOldToolOutputs().script([Segment("user", 0, 3), Segment("tool_output", 4, 9)])
    with pytest.raises(InvalidRequestError):
        DropOldToolOutputs(keep_turns=-1)
