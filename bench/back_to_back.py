#!/usr/bin/env python3
"""Loads back to back (issue 16): the time to first layer when the previous load's bookkeeping
is still to run, with that bookkeeping held until the first layer (the default) against run
at once on the load pool (the baseline: the path before ``tenantkv.datapath.first_layers``).

A server loads one prefix after another; each load's record of use (an index write) goes to
the background when it closes, and the next load starts at once. For each size a DeepSeek-V3
shaped MLA prefix (576 bf16 values per token per layer; ``--layers`` per size: the first layer
is one layer whatever their number) is stored once, durable, then ``--rounds`` rounds each
run ``--loads`` loads of every case in turn (the order alternates between rounds), no pause
and no ``gc.collect()`` between loads of a case, layers written to preallocated ``out=``
buffers. Each case starts with one untimed load, so its first timed load follows a load of
its own case. The baseline is made by pointing ``Runtime.submit_background`` back at the load
pool, as it was.

Output: min / median / max of the time to first layer, of the time to the stream (``load``
returning) and of the whole load, per case and size; ratios of medians to the baseline of
the same run; ``bench/results/back_to_back.png`` and ``back_to_back.json`` (``--out``).

Run:  .venv/bin/python bench/back_to_back.py [--tokens 8192,131072] [--layers 61,16]
      [--rounds 6] [--loads 10]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _cli import bench_parser, block_sizes, finish_ab, int_list
from _common import format_stats_table, print_machine, tokens_label
from _fixtures import (
    VALUES_PER_TOKEN,
    deepseek_layout,
    random_layers,
    tenant_namespace,
    timed_load,
    torch_tokens,
)
from _plots import median_bars, pyplot, save_figure

import tenantkv

STEP_TOKENS = 16_384  # tokens per store: a conversation's turns
BASELINE = "bookkeeping at once (before)"
HELD = "bookkeeping after first layers"


def as_load_pool(runtime: Any) -> Callable[[], None]:
    """Make ``runtime`` hand bookkeeping straight to its load pool; return the undo."""

    def submit(task: Callable[..., object], *args: object) -> None:
        runtime.load_executor.submit(task, *args)

    runtime.submit_background = submit
    return lambda: runtime.__dict__.pop("submit_background", None)


def measure(root: Path, num_tokens: int, layers: int, rounds: int, loads: int) -> dict[str, Any]:
    layout = deepseek_layout(layers)
    generator = torch.Generator().manual_seed(num_tokens)
    tokens = torch_tokens(num_tokens, generator)
    timings: dict[str, dict[str, list[float]]] = {
        case: {"stream": [], "first layer": [], "load": []} for case in (BASELINE, HELD)
    }
    with tenantkv.open(root) as kv:
        quota = 2 * num_tokens * layers * VALUES_PER_TOKEN * 2 + 2**30
        ns = tenant_namespace(kv, "bench", layout, quota_bytes=quota)
        for start in range(0, num_tokens, STEP_TOKENS):
            end = min(start + STEP_TOKENS, num_tokens)
            ns.store(tokens[:end], random_layers(layout, end - start, generator), start=start)
        out = [torch.zeros(num_tokens, VALUES_PER_TOKEN, dtype=layout.dtype) for _ in range(layers)]
        runtime = kv.context.runtime
        for round_index in range(rounds):
            cases = [BASELINE, HELD] if round_index % 2 == 0 else [HELD, BASELINE]
            for case in cases:
                undo = as_load_pool(runtime) if case == BASELINE else (lambda: None)
                try:
                    timed_load(ns, tokens, out=out)  # untimed: the next follows its own case
                    for _ in range(loads):
                        times = timed_load(ns, tokens, out=out)
                        timings[case]["stream"].append(times.stream)
                        timings[case]["first layer"].append(times.first)
                        timings[case]["load"].append(times.total)
                finally:
                    undo()
                time.sleep(0.2)  # the case's last bookkeeping runs before the next case
            print(f"  [{tokens_label(num_tokens)}] round {round_index + 1}/{rounds}", flush=True)
    return {"tokens": num_tokens, "layers": layers, "timings": timings}


def report(results: list[dict[str, Any]]) -> dict[str, Any]:
    verdicts: dict[str, Any] = {}
    for result in results:
        label = f"{tokens_label(result['tokens'])} tokens x {result['layers']} layers"
        rows = []
        for case, parts in result["timings"].items():
            for part, values in parts.items():
                base = statistics.median(result["timings"][BASELINE][part])
                note = f"{statistics.median(values) / base:.3f}x"
                rows.append((f"{case}: {part}", [v * 1e3 for v in values], note))
        print(f"\n{label}")
        print(format_stats_table(rows, "ms", label="case: time to", note_header="/ before"))
        verdicts[label] = {
            part: statistics.median(result["timings"][HELD][part])
            / statistics.median(result["timings"][BASELINE][part])
            for part in ("stream", "first layer", "load")
        }
    return verdicts


def plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 5), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        parts = ["stream", "first layer"]
        width = 0.38
        for i, case in enumerate((BASELINE, HELD)):
            values = [[v * 1e3 for v in result["timings"][case][part]] for part in parts]
            median_bars(
                ax,
                [x + i * width for x in range(len(parts))],
                values,
                width,
                label=case,
                color="#999999" if case == BASELINE else None,
            )
        ax.set_xticks([x + width / 2 for x in range(len(parts))], parts)
        ax.set_ylabel("ms from the call (median, min-max)")
        ax.set_title(f"{tokens_label(result['tokens'])} tokens, loads back to back")
        ax.legend()
    save_figure(fig, path, dpi=110)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--tokens", type=block_sizes, default="8192,131072")
    parser.add_argument("--layers", type=int_list, default="61,16", help="one per --tokens size")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--loads", type=int, default=10, help="timed loads per case per round")
    args = parser.parse_args()
    if len(args.layers) != len(args.tokens):
        parser.error("--layers takes one number per --tokens size")
    print_machine(args.dir)
    results = []
    for num_tokens, num_layers in zip(args.tokens, args.layers, strict=True):
        with tempfile.TemporaryDirectory(prefix="tkv-b2b-", dir=args.dir) as root:
            results.append(measure(Path(root), num_tokens, num_layers, args.rounds, args.loads))
    verdicts = report(results)
    finish_ab(
        "Medians, held / before (below 1: sooner):",
        verdicts,
        args.out,
        "back_to_back",
        lambda path: plot(results, path),
        results,
    )


if __name__ == "__main__":
    main()
