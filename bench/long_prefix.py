#!/usr/bin/env python3
"""Long prefixes: does tenantkv keep its speed, first-layer latency and memory at 128K tokens?

A 61-layer DeepSeek-V3-shaped prefix (MLA, 576 bf16 values = 1,152 B per token per layer) at a
short size (``--short``, default 8,192 tokens = 0.58 GB) and a long one (``--long``, default
131,072 tokens = 9.2 GB), in one run, on the embedded default (SQLite, a local directory, durable
stores):

* **store**: the short prefix stored whole, ``--reps`` times (a fresh prefix each time); the
  long one stored the way a growing conversation is, in ``--step``-token steps (default 16,384:
  eight steps for 128K) with ``start=``, each step passing only its new tokens. GB/s of
  plaintext over the timed ``ns.store`` calls; per step for the long prefix.
* **load**: fresh tensors, each layer dropped as it arrives (``for i, layer in stream``),
  ``--reps`` times per size in alternating order. GB/s (call to last layer), time to first
  layer (TTFL), and TTFL against one layer's share of the load time (total / layers).
* **peak RSS** of one load per size, in a fresh subprocess (the cache opened, the prefix looked
  up, ``gc.collect()``, then RSS sampled every millisecond through the load): the growth over the
  baseline must not grow with the prefix beyond a few layers (docs/perf.md states the bound).

Every stored byte is checked once per size (an untimed load), against data that is cheap to
regenerate: layer ``l`` of step ``s`` is a fixed random block plus ``s * layers + l`` (as int16,
wrapping), so a misplaced row or layer shows.

Targets (issue "Performance"): long-prefix load and store GB/s >= 0.8x the short prefix's, and
the long prefix's TTFL <= 1.5x one layer's share of its load time.

Each length has a cache of its own; with ``--one-cache`` both lie in one cache, whose layer pool
then serves loads of both lengths in turn (as a server's does).

Run:  .venv/bin/python bench/long_prefix.py [--short 8192] [--long 131072] [--step 16384]
      [--reps 3] [--one-cache] [--dir /tmp] [--out bench/results]

The long prefix needs its size in free disk and, to measure warm loads, in page cache
(9.2 GB at 128K), plus a step's tensors (1.2 GB at 16K tokens).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _cli import bench_parser, run_child, write_outputs
from _common import GB, format_ratios, format_stats_table, print_machine, tokens_label
from _fixtures import LAYERS, VALUES_PER_TOKEN, deepseek_layout, random_tokens, timed_load
from _plots import median_bars, pyplot, save_figure

TOKEN_BYTES = VALUES_PER_TOKEN * 2
PAGE = os.sysconf("SC_PAGE_SIZE")


def open_cache(root: Path) -> tuple[Any, Any]:
    import tenantkv

    kv = tenantkv.open(root)
    if "bench" not in {t.name for t in kv.list_tenants()}:
        kv.create_tenant("bench", quota_bytes=64 << 30)
    return kv, kv.namespace("bench", model="deepseek-v3", layout=deepseek_layout(LAYERS))


def prefix_tokens(seed: int, count: int) -> list[int]:
    return random_tokens(random.Random(seed), count)


class Data:
    """Cheap, checkable layer data: a random base block plus (step * layers + layer)."""

    def __init__(self, step_tokens: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.base = torch.randint(
            -(2**15), 2**15, (step_tokens, VALUES_PER_TOKEN), dtype=torch.int16, generator=generator
        )

    def layer(self, step: int, layer: int, rows: int) -> torch.Tensor:
        return (self.base[:rows] + (step * LAYERS + layer)).view(torch.bfloat16)

    def matches(self, got: torch.Tensor, step: int, layer: int, first: int, rows: int) -> bool:
        want = self.base[:rows] + (step * LAYERS + layer)
        return torch.equal(got[first : first + rows].view(torch.int16), want)


def store_prefix(ns: Any, tokens: list[int], data: Data, step: int) -> list[float]:
    """Store ``tokens`` in steps of ``step`` tokens (``start=``); seconds per step."""
    seconds = []
    for index, start in enumerate(range(0, len(tokens), step)):
        end = min(start + step, len(tokens))
        layers = [data.layer(index, layer, end - start) for layer in range(LAYERS)]
        gc.collect()
        t0 = time.perf_counter()
        stored = ns.store(tokens[:end], layers, start=start)
        seconds.append(time.perf_counter() - t0)
        if stored != end - start:
            raise RuntimeError(f"step {index}: stored {stored} of {end - start} tokens")
        del layers
    return seconds


def check_load(ns: Any, tokens: list[int], data: Data, step: int) -> None:
    with ns.load(tokens) as stream:
        for layer_index, layer in stream:
            for index, start in enumerate(range(0, len(tokens), step)):
                rows = min(step, len(tokens) - start)
                if not data.matches(layer, index, layer_index, start, rows):
                    raise AssertionError(f"layer {layer_index}, step {index}: wrong bytes")


# --------------------------------------------------------------------------- #
# Peak RSS, in a fresh process per size
# --------------------------------------------------------------------------- #


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def rss_child(root: str, seed: int, count: int) -> dict[str, float]:
    kv, ns = open_cache(Path(root))
    tokens = prefix_tokens(seed, count)
    if ns.lookup(tokens) != count:
        raise RuntimeError("the prefix is not cached")
    gc.collect()
    baseline = _rss()
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    timed_load(ns, tokens)  # layers dropped as they arrive
    done.set()
    sampler.join()
    peak = max(peak, _rss())
    kv.close()
    return {"baseline_mib": baseline / 2**20, "peak_growth_mib": (peak - baseline) / 2**20}


def measure_rss(root: Path, seed: int, count: int) -> dict[str, float]:
    spec = {"root": str(root), "seed": seed, "count": count}
    return dict(run_child(__file__, "--rss-child", spec))


# --------------------------------------------------------------------------- #
# One size
# --------------------------------------------------------------------------- #


@dataclass
class SizeResult:
    tokens: int
    store_seconds: list[float] = field(default_factory=list)  # per store call
    store_bytes: list[int] = field(default_factory=list)
    ttfl: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    rss: dict[str, float] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.tokens * TOKEN_BYTES * LAYERS

    @property
    def label(self) -> str:
        return tokens_label(self.tokens)

    def store_gbps(self) -> list[float]:
        return [b / s / GB for b, s in zip(self.store_bytes, self.store_seconds, strict=True)]

    def store_overall_gbps(self) -> float:
        return sum(self.store_bytes) / sum(self.store_seconds) / GB

    def load_gbps(self) -> list[float]:
        return [self.nbytes / s / GB for s in self.total]


def prepare(
    root: Path,
    result: SizeResult,
    step: int,
    reps: int,
    seed: int,
    whole: bool,
    opened: tuple[Any, Any] | None = None,
) -> tuple[Any, Any, list[int], Data]:
    """Store the size's prefix (timed) in the cache at ``root``, or in the cache and
    namespace ``opened``; return the cache, namespace, tokens and data."""
    kv, ns = opened if opened is not None else open_cache(root)
    data = Data(min(step, result.tokens), seed)
    tokens = prefix_tokens(seed, result.tokens)
    store_step = result.tokens if whole else step
    if whole:
        # More store samples: other prefixes of the same size, kept (0.6 GB each at 8K).
        for rep in range(reps - 1):
            extra = prefix_tokens(seed + 1000 + rep, result.tokens)
            result.store_seconds += store_prefix(ns, extra, data, store_step)
            result.store_bytes.append(result.nbytes)
    seconds = store_prefix(ns, tokens, data, store_step)
    result.store_seconds += seconds
    for start in range(0, result.tokens, store_step):
        result.store_bytes.append(min(store_step, result.tokens - start) * TOKEN_BYTES * LAYERS)
    if ns.lookup(tokens) != result.tokens:
        raise RuntimeError("the stored prefix does not look up whole")
    print(f"[{result.label}] checking every loaded byte (untimed) ...", flush=True)
    check_load(ns, tokens, data, min(step, result.tokens))
    return kv, ns, tokens, data


def meets(ok: bool, target: str = ">= 0.8") -> str:
    return f"{'meets' if ok else 'MISSES'} {target}"


def report(results: list[SizeResult], step: int) -> dict[str, Any]:
    short, long = results
    print("\nStore (durable, GB/s of plaintext per ns.store call)")
    rows = [
        (
            f"{r.label} ({'whole' if r is short else f'{tokens_label(step)} steps'})",
            r.store_gbps(),
            f"{r.store_overall_gbps():.3f}",
        )
        for r in results
    ]
    print(format_stats_table(rows, "", label="size", digits=3, note_header="overall"))
    print("\nLoad, fresh tensors dropped as they arrive (GB/s; ms)")
    rows = []
    for r in results:
        rows.append((f"{r.label} load GB/s", r.load_gbps(), ""))
        rows.append((f"{r.label} TTFL ms", [t * 1e3 for t in r.ttfl], ""))
        rows.append((f"{r.label} layer share ms", [t / LAYERS * 1e3 for t in r.total], ""))
        ratio = [f / (t / LAYERS) for f, t in zip(r.ttfl, r.total, strict=True)]
        rows.append((f"{r.label} TTFL / share", ratio, ""))
    print(format_stats_table(rows, "", label="size / metric", digits=3))
    print("\nPeak RSS growth of one load (fresh process, sampled every ms)")
    for r in results:
        layer_mib = r.tokens * TOKEN_BYTES / 2**20
        print(
            f"  {r.label}: {r.rss['peak_growth_mib']:.0f} MiB "
            f"(= {r.rss['peak_growth_mib'] / layer_mib:.1f} layers of {layer_mib:.1f} MiB; "
            f"baseline {r.rss['baseline_mib']:.0f} MiB)"
        )
    load_ratio = statistics.median(long.load_gbps()) / statistics.median(short.load_gbps())
    store_ratio = long.store_overall_gbps() / short.store_overall_gbps()
    ttfl_ratio = statistics.median(long.ttfl) / (statistics.median(long.total) / LAYERS)
    verdict = {
        "load_long_over_short": load_ratio,
        "store_long_over_short": store_ratio,
        "long_ttfl_over_layer_share": ttfl_ratio,
    }
    print("\nTargets (medians, same run)")
    print(
        format_ratios(
            [
                (f"{long.label} load / {short.label} load", load_ratio, meets(load_ratio >= 0.8)),
                (
                    f"{long.label} store / {short.label} store",
                    store_ratio,
                    meets(store_ratio >= 0.8),
                ),
                (
                    f"{long.label} TTFL / layer share",
                    ttfl_ratio,
                    meets(ttfl_ratio <= 1.5, "<= 1.5"),
                ),
            ]
        )
    )
    return verdict


def plot(results: list[SizeResult], path: Path) -> None:
    fig, axes = pyplot().subplots(1, 3, figsize=(14, 4.5))
    labels = [r.label for r in results]
    for ax, title, series in (
        (axes[0], "store GB/s (per call)", [r.store_gbps() for r in results]),
        (axes[1], "load GB/s (fresh, dropped)", [r.load_gbps() for r in results]),
        (
            axes[2],
            "TTFL / layer share",
            [[f / (t / LAYERS) for f, t in zip(r.ttfl, r.total, strict=True)] for r in results],
        ),
    ):
        median_bars(ax, labels, series, capsize=5, color="#ff7f0e")
        ax.set_title(title)
    axes[2].axhline(1.5, color="red", linestyle="--", linewidth=1)
    fig.suptitle("tenantkv, 61-layer DeepSeek-V3 MLA prefix: short vs long (median, min-max)")
    save_figure(fig, path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(__doc__, reps=3)
    parser.add_argument("--short", type=int, default=8192)
    parser.add_argument("--long", type=int, default=131_072)
    parser.add_argument("--step", type=int, default=16_384)
    parser.add_argument(
        "--one-cache",
        action="store_true",
        help="both prefixes in one cache (one layer pool, as a server loading prompts of "
        "several lengths has), instead of a cache per length",
    )
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        spec = json.loads(args.rss_child)
        print(json.dumps(rss_child(spec["root"], spec["seed"], spec["count"])))
        return 0
    for value in (args.short, args.long, args.step):
        if value <= 0 or value % 64:
            parser.error("sizes and the step must be positive multiples of 64")
    workdir = Path(tempfile.mkdtemp(prefix="tenantkv-long-", dir=args.dir))
    print_machine(workdir)
    results = [SizeResult(args.short), SizeResult(args.long)]
    caches = []
    try:
        for index, result in enumerate(results):
            print(f"[{result.label}] storing {result.nbytes / GB:.2f} GB ...", flush=True)
            root = workdir / ("cache" if args.one_cache else result.label)
            opened = (caches[0][1], caches[0][2]) if args.one_cache and caches else None
            caches.append(
                (
                    root,
                    *prepare(
                        root,
                        result,
                        args.step,
                        args.reps,
                        7 + index,
                        whole=index == 0,
                        opened=opened,
                    ),
                )
            )
        for _rep in range(args.reps):  # alternating sizes, so drifting load hits both
            for result, (_, _, ns, tokens, _) in zip(results, caches, strict=True):
                gc.collect()
                times = timed_load(ns, tokens)
                result.ttfl.append(times.first)
                result.total.append(times.total)
        for _, kv, _, _, _ in caches:
            kv.close()  # once per cache: closing a closed cache does nothing
        for result, (root, _, _, _, _) in zip(results, caches, strict=True):
            result.rss = measure_rss(root, 7 + results.index(result), result.tokens)
        verdict = report(results, args.step)
        data = {
            "results": [
                {
                    "tokens": r.tokens,
                    "store_gbps": r.store_gbps(),
                    "load_gbps": r.load_gbps(),
                    "ttfl_s": r.ttfl,
                    "rss": r.rss,
                }
                for r in results
            ],
            "targets": verdict,
        }
        write_outputs(args.out, "long_prefix", data, lambda png: plot(results, png))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
