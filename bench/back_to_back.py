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

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import finish_ab, format_stats_table, machine_info, median_bars, print_kv

import tenantkv

HERE = Path(__file__).resolve().parent
STEP_TOKENS = 16_384  # tokens per store: a conversation's turns
WIDTH = 512 + 64
BASELINE = "bookkeeping at once (before)"
HELD = "bookkeeping after first layers"


def size_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def as_load_pool(runtime: Any) -> Callable[[], None]:
    """Make ``runtime`` hand bookkeeping straight to its load pool; return the undo."""

    def submit(task: Callable[..., object], *args: object) -> None:
        runtime.load_executor.submit(task, *args)

    runtime.submit_background = submit
    return lambda: runtime.__dict__.pop("submit_background", None)


def timed_load(ns: Any, tokens: list[int], out: list[torch.Tensor]) -> tuple[float, float, float]:
    """(seconds to the stream, to the first layer, to the last) of one load."""
    t0 = time.perf_counter()
    first = 0.0
    with ns.load(tokens, out=out) as stream:
        opened = time.perf_counter()
        for index, _layer in stream:
            if index == 0:
                first = time.perf_counter()
    return opened - t0, first - t0, time.perf_counter() - t0


def measure(root: Path, num_tokens: int, layers: int, rounds: int, loads: int) -> dict[str, Any]:
    layout = tenantkv.KVLayout.mla(
        num_layers=layers, kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16
    )
    generator = torch.Generator().manual_seed(num_tokens)
    tokens = torch.randint(0, 50_000, (num_tokens,), generator=generator).tolist()
    timings: dict[str, dict[str, list[float]]] = {
        case: {"stream": [], "first layer": [], "load": []} for case in (BASELINE, HELD)
    }
    with tenantkv.open(root) as kv:
        kv.create_tenant("bench", quota_bytes=2 * num_tokens * layers * WIDTH * 2 + 2**30)
        ns = kv.namespace("bench", model="deepseek-v3", layout=layout)
        for start in range(0, num_tokens, STEP_TOKENS):
            end = min(start + STEP_TOKENS, num_tokens)
            data = [torch.randn(end - start, WIDTH, generator=generator) for _ in range(layers)]
            ns.store(tokens[:end], [d.to(torch.bfloat16) for d in data], start=start)
        out = [torch.zeros(num_tokens, WIDTH, dtype=torch.bfloat16) for _ in range(layers)]
        runtime = kv.context.runtime
        for round_index in range(rounds):
            cases = [BASELINE, HELD] if round_index % 2 == 0 else [HELD, BASELINE]
            for case in cases:
                undo = as_load_pool(runtime) if case == BASELINE else (lambda: None)
                try:
                    timed_load(ns, tokens, out)  # untimed: the next follows its own case
                    for _ in range(loads):
                        stream, first, total = timed_load(ns, tokens, out)
                        timings[case]["stream"].append(stream)
                        timings[case]["first layer"].append(first)
                        timings[case]["load"].append(total)
                finally:
                    undo()
                time.sleep(0.2)  # the case's last bookkeeping runs before the next case
            print(f"  [{size_label(num_tokens)}] round {round_index + 1}/{rounds}", flush=True)
    return {"tokens": num_tokens, "layers": layers, "timings": timings}


def report(results: list[dict[str, Any]]) -> dict[str, Any]:
    verdicts: dict[str, Any] = {}
    for result in results:
        label = f"{size_label(result['tokens'])} tokens x {result['layers']} layers"
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        ax.set_title(f"{size_label(result['tokens'])} tokens, loads back to back")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,131072")
    parser.add_argument("--layers", default="61,16", help="layers per size (one per --tokens)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--loads", type=int, default=10, help="timed loads per case per round")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--dir", type=Path, default=None, help="where the caches go (temporary)")
    args = parser.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    layers = [int(n) for n in args.layers.split(",")]
    if len(layers) != len(sizes):
        parser.error("--layers takes one number per --tokens size")
    print_kv("Machine", machine_info(str(args.dir or tempfile.gettempdir())))
    results = []
    for num_tokens, num_layers in zip(sizes, layers, strict=True):
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
