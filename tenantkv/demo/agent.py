"""The demo's agent turn with the drop-old-tool-outputs policy on.

The agent keeps its whole transcript; the policy says which old tool outputs leave the model's
context. Three ways to serve that turn, each counted, two of them run:

* keep: the whole history; the cache restores everything but the new messages (counted);
* trim: the old tool outputs cut from the text; the cache only restores the blocks before the
  first cut, everything after it is computed again (run);
* drop+repos: the cached prefix restored, the tool outputs dropped from it and the rest
  repositioned (``PrefixCache.edit``); only the new messages are computed (run). The edited
  conversation is saved on its own key chain, and the next turn restores it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TextIO

import torch

from ..editing import DropOldToolOutputs, Segment
from ..integrations.transformers import PrefixCache
from .conversation import SEGMENT_ROLES, encode
from .model import greedy


@dataclass
class AgentTurnResult:
    """What the policy-on turn computed under each strategy, and whether the next turn hit."""

    history_tokens: int
    dropped_tokens: int
    keep_computed: int
    trim_context: int
    trim_computed: int
    trim_ttft_s: float  # restore of the blocks before the cut + forward pass, to the first token
    edit_context: int
    edit_computed: int
    edit_ttft_s: float  # restore + edit + forward pass of the new tokens, to the first token
    edit_saved: int = 0
    next_expected: int = 0
    next_hit: int = 0


def transcript(parts: list[tuple[str, list[int]]]) -> list[Segment]:
    """Segments with token spans for (demo role, tokens) parts, in order."""
    segments = []
    position = 0
    for role, tokens in parts:
        segments.append(Segment(SEGMENT_ROLES[role], position, position + len(tokens)))  # type: ignore[arg-type]
        position += len(tokens)
    return segments


def agent_turn(
    prefixes: PrefixCache,
    parts: list[tuple[str, list[int]]],
    policy: DropOldToolOutputs,
    new_tokens: int,
    out: TextIO,
) -> AgentTurnResult:
    """Serve the turn whose history is ``parts`` with ``policy``; compare with trimming."""
    history = [token for _, tokens in parts for token in tokens]
    script = policy.script(transcript(parts))
    model = prefixes.model
    keep_cached = prefixes.lookup(history)

    trimmed = script.apply_to_tokens(torch.tensor(history)).tolist()
    started = time.perf_counter()
    restored_trimmed = prefixes.restore(trimmed)
    trim_restore = time.perf_counter() - started
    trim_ttft = trim_restore + greedy(model, trimmed, restored_trimmed.cache, 1).ttft_s

    started = time.perf_counter()
    restored = prefixes.restore(history)
    edited = prefixes.edit(restored, history, script)
    edit_setup = time.perf_counter() - started
    edited_ids = edited.tokens[0].tolist()
    generation = greedy(model, edited_ids, edited.cache, new_tokens)
    result = AgentTurnResult(
        history_tokens=len(history),
        dropped_tokens=script.dropped_tokens(),
        keep_computed=len(history) - keep_cached,
        trim_context=len(trimmed),
        trim_computed=len(trimmed) - restored_trimmed.num_tokens,
        trim_ttft_s=trim_ttft,
        edit_context=len(edited_ids),
        edit_computed=len(edited_ids) - edited.num_tokens,
        edit_ttft_s=edit_setup + generation.ttft_s,
    )
    result.edit_saved = prefixes.save(
        edited_ids + generation.tokens, generation.cache, kind="agent", origin=edited.origin
    )
    following = edited_ids + generation.tokens + encode("user", "Thanks. Open a pull request.")
    block = prefixes.namespace.block_tokens
    result.next_expected = (len(edited_ids) + len(generation.tokens) - 1) // block * block
    result.next_hit = prefixes.lookup(following, origin=edited.origin)
    print(
        f"    policy: drop tool outputs older than the last {policy.keep_turns} turn(s): "
        f"{result.dropped_tokens:,} of {result.history_tokens:,} tokens leave the context",
        file=out,
    )
    return result
