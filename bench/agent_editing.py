#!/usr/bin/env python3
"""Agent sessions: keep the history, trim old tool outputs, or drop+repos them in the cache.

Synthetic multi-turn agent transcripts: a system prompt, then per turn a user message, a tool
call, a tool output and an assistant message (``--turns``, ``--tool-tokens`` vary the number
of turns and the tool-output size). Before each turn's answer the agent sends its history; each
strategy keeps the previous turn's KV cache in memory and computes what it must (each turn
ends with the assistant's answer, whose KV the next turn finds cached):

* (a) keep   -- the whole history; the cache covers everything but the new turn's tokens;
* (b) trim   -- tool outputs older than the last ``--keep-turns`` turns are cut from the text;
  the cache holds the previous (trimmed) context, so everything after the first newly cut
  span is recomputed;
* (c) drop+repos -- the same tool outputs leave the cache (``PrefixCache.edit_cache``: drop,
  then the retained keys rotated to contiguous positions); only the new turn is computed.

Counted exactly per turn and in total: tokens recomputed (prefilled), tokens attended (the
turn's context length: what its new tokens and its answer attend to), and billing as
``recomputed + hit_cost x reused`` tokens for a hit costing 1/50 of a miss (tenantkv's metering
default, DeepSeek's ratio), 1/10, and 1 (no discount for cached tokens: billing is then the
context). Timed on tiny
random models on CPU (the demo's DeepSeek-V3-style MLA model and a tiny Llama): the
per-session total of every turn's edit and forward pass, ``--reps`` sessions per strategy,
round-robin; min / median / max and ratios to (a) keep measured in the same run. A PNG plot.

Before timing, (c)'s cache is checked to hold the same number of tokens as (b)'s context, and
each strategy's last logits are checked to be finite.

Run:  .venv/bin/python bench/agent_editing.py [--turns 4,8] [--tool-tokens 128,512]
      [--keep-turns 2] [--reps 3] [--out DIR]
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _cli import bench_parser, int_list, write_outputs
from _common import format_stats_table, print_machine
from _fixtures import random_llama
from _plots import median_bars, pyplot, save_figure

import tenantkv
from tenantkv.demo.model import FAST, build_model
from tenantkv.editing import DropOldToolOutputs, EditScript, Segment
from tenantkv.integrations.transformers import PrefixCache

STRATEGIES = ("keep", "trim", "drop+repos")
HIT_COST = 1 / 50
SYSTEM, USER, CALL, ANSWER = 200, 40, 24, 48


def transcript(turns: int, tool_tokens: int) -> list[Segment]:
    """The whole session: system, then per turn user, tool call, tool output, assistant."""
    segments = [Segment("system", 0, SYSTEM)]
    position = SYSTEM
    for _ in range(turns):
        for role, length in (
            ("user", USER),
            ("tool_call", CALL),
            ("tool_output", tool_tokens),
            ("assistant", ANSWER),
        ):
            segments.append(Segment(role, position, position + length))  # type: ignore[arg-type]
            position += length
    return segments


def requests(session: list[Segment]) -> list[list[Segment]]:
    """What each turn computes: everything up to the end of that turn's assistant message
    (prefilled here; an engine decodes the answer, and its KV is cached the same way)."""
    cuts = [i + 1 for i, segment in enumerate(session) if segment.role == "assistant"]
    return [session[:cut] for cut in cuts]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


@dataclass
class Counts:
    recomputed: list[int]
    attended: list[int]
    billed: list[float]


def count_tokens(session: list[Segment], policy: DropOldToolOutputs) -> dict[str, Counts]:
    """Exact token counts per turn for each strategy (positions stand in for token ids)."""
    counts = {name: Counts([], [], []) for name in STRATEGIES}
    previous: dict[str, list[int]] = {name: [] for name in STRATEGIES}
    for request in requests(session):
        full = list(range(request[-1].stop))
        trimmed = policy.script(request).apply_to_tokens(torch.tensor(full)).tolist()
        contexts = {"keep": full, "trim": trimmed, "drop+repos": trimmed}
        for name in STRATEGIES:
            context = contexts[name]
            if name == "drop+repos":
                # the cache holds the previous context less the newly dropped spans: all reused
                retained = set(context)
                kept = [token for token in previous[name] if token in retained]
                assert kept == context[: len(kept)], "an edit keeps the order of what it retains"
                reused = len(kept)
            else:
                reused = _common_prefix(previous[name], context)
            computed = len(context) - reused
            counts[name].recomputed.append(computed)
            counts[name].attended.append(len(context))
            counts[name].billed.append(computed + HIT_COST * reused)
            previous[name] = context
    return counts


def _forward(model: Any, ids: list[int], cache: Any) -> Any:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return out.logits[0, -1]


def run_session(
    model: Any, prefixes: PrefixCache, session: list[Segment], policy: Any, strategy: str
) -> float:
    """Seconds of one session's edits and forward passes under ``strategy``."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(len(session))
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (session[-1].stop,), generator=generator)
    cache = DynamicCache(config=model.config)
    context: list[int] = []
    seconds = 0.0
    logits = None
    applied = EditScript(())  # drop+repos: the spans already gone from the cache
    for request in requests(session):
        full = tokens[: request[-1].stop]
        script = policy.script(request) if strategy != "keep" else EditScript(())
        started = time.perf_counter()
        if strategy == "keep":
            new_context = full.tolist()
            reused = len(context)
        elif strategy == "trim":
            new_context = script.apply_to_tokens(full).tolist()
            reused = _common_prefix(context, new_context)
            if reused < cache.get_seq_length():
                cache.crop(reused - cache.get_seq_length())
        else:
            cached = cache.get_seq_length()
            # drops not yet applied to the cache, in the cache's (edited) coordinates
            new_drops = _new_drops(applied, script)
            if cached and not new_drops.is_empty:
                cache = prefixes.edit_cache(cache, new_drops)
            applied = script
            new_context = script.apply_to_tokens(full).tolist()
            reused = cache.get_seq_length()
        logits = _forward(model, new_context[reused:], cache)
        seconds += time.perf_counter() - started
        context = new_context
        if strategy == "drop+repos":
            assert cache.get_seq_length() == len(new_context)
    assert logits is not None and torch.isfinite(logits).all()
    return seconds


def _new_drops(done: EditScript, wanted: EditScript) -> EditScript:
    """The spans of ``wanted`` not in ``done``, moved into the coordinates of a sequence from
    which ``done``'s spans are already gone (policies only ever add spans)."""
    done_spans = set(done.drops)
    assert done_spans <= set(wanted.drops), "the policy drops a span it did not drop before"
    spans = []
    for start, stop in wanted.drops:
        if (start, stop) in done_spans:
            continue
        shift = sum(b - a for a, b in done.drops if b <= start)
        spans.append((start - shift, stop - shift))
    return EditScript.dropping(spans)


def plot(results: dict[str, Any], path: Path) -> None:
    cases = list(results)
    fig, axes = pyplot().subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(STRATEGIES)
    for index, name in enumerate(STRATEGIES):
        xs = [i + (index - 1) * width for i in range(len(cases))]
        recomputed = [sum(results[c]["counts"][name]["recomputed"]) for c in cases]
        axes[0].bar(xs, recomputed, width, label=name)
        samples = [[s * 1e3 for s in results[c]["seconds"][name]] for c in cases]
        median_bars(axes[1], xs, samples, width, edgecolor=None, label=name)
    labels = ("tokens recomputed per session", "ms per session (median)")
    for ax, label in zip(axes, labels, strict=True):
        ticks = [
            c.replace("deepseek-v3-", "").replace("llama-", "").replace(" ", "\n") for c in cases
        ]
        ax.set_xticks(range(len(cases)), ticks, fontsize=7)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("agent sessions: keep vs trim+recompute vs drop+repos (tiny models, CPU)")
    save_figure(fig, path)


def _tiny_llama() -> Any:
    return random_llama(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16_384,
    ).eval()


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, reps=3, data_dir=False)
    parser.add_argument("--turns", type=int_list, default="4,8")
    parser.add_argument("--tool-tokens", type=int_list, default="128,512")
    parser.add_argument("--keep-turns", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (shared machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print_machine(tempfile.gettempdir())
    policy = DropOldToolOutputs(keep_turns=args.keep_turns)
    models = {"deepseek-v3-mla": build_model(FAST), "llama-gqa": _tiny_llama()}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as root, tenantkv.open(root, durable=False) as kv:
        kv.create_tenant("bench")
        for model_name, model in models.items():
            prefixes = PrefixCache(kv, "bench", model)
            for turns in args.turns:
                for tool in args.tool_tokens:
                    session = transcript(turns, tool)
                    counts = count_tokens(session, policy)
                    seconds: dict[str, list[float]] = {name: [] for name in STRATEGIES}
                    for name in STRATEGIES:  # untimed warm-up
                        run_session(model, prefixes, session, policy, name)
                    for _ in range(args.reps):
                        for name in STRATEGIES:
                            gc.collect()
                            seconds[name].append(
                                run_session(model, prefixes, session, policy, name)
                            )
                    case = f"{model_name} {turns}turns tool{tool}"
                    results[case] = {
                        "counts": {n: vars(c) for n, c in counts.items()},
                        "seconds": seconds,
                    }
                    _report(case, counts, seconds)
    write_outputs(args.out, "agent_editing", results, lambda png: plot(results, png), indent=1)
    return 0


BILLING_HIT_COSTS = (HIT_COST, 1 / 10, 1.0)


def billed(counts: Counts, hit_cost: float) -> float:
    """A session's bill in miss-token units: recomputed tokens, plus reused ones at
    ``hit_cost`` (reused = the context less what the turn computed)."""
    return sum(
        computed + hit_cost * (attended - computed)
        for computed, attended in zip(counts.recomputed, counts.attended, strict=True)
    )


def _report(case: str, counts: dict[str, Counts], seconds: dict[str, list[float]]) -> None:
    print(f"\n{case}")
    keep = counts["keep"]
    for name in STRATEGIES:
        c = counts[name]
        savings = "  ".join(
            f"{1 - billed(c, cost) / billed(keep, cost):+.1%}" for cost in BILLING_HIT_COSTS
        )
        print(
            f"  {name:<10} recomputed {sum(c.recomputed):>6}  attended {sum(c.attended):>7} "
            f"({sum(c.attended) / sum(keep.attended):.2f}x keep)  billing saved vs keep at a hit "
            f"cost of 1/50, 1/10, 1: {savings}"
        )
    rows = [(name, [s * 1e3 for s in seconds[name]], "") for name in STRATEGIES]
    print(format_stats_table(rows, "ms", label="session time", digits=1))
    keep_median = statistics.median(seconds["keep"])
    for name in STRATEGIES[1:]:
        print(f"  {name}: {statistics.median(seconds[name]) / keep_median:.2f}x keep's time")


if __name__ == "__main__":
    sys.exit(main())
