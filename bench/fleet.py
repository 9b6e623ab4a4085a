#!/usr/bin/env python3
"""Fleet measurements (issue 14): the index on PostgreSQL next to SQLite, and two nodes at once.

1. Lookup of a long prompt (``--lookup-tokens``, default 131,072 = 128K tokens = 2,048 blocks),
   fully cached (a hit of every block) and not cached at all (a miss at the first block), with
   the index on SQLite (the embedded default, ``<root>/index.db``) and on PostgreSQL (a schema
   of its own on ``--postgres``, dropped at the end). The KV is a 1-layer MLA prefix: a lookup
   reads only the index, so the KV's size does not matter. Baseline: SQLite's hit, same run.
   A lookup computes the prompt's 2,048 keyed block hashes and asks the index for them (one
   query, in chunks); a miss stops at the first block.
2. Two node processes loading at once from one shared directory and one PostgreSQL index:
   a ``--layers``-layer DeepSeek-V3-shaped prefix (576 bf16 values per token per layer) of
   ``--load-tokens`` tokens, stored once; each node opens its own ``TenantKV`` on the root,
   checks one load byte-exact (untimed), then both start together (a line on stdin, sent once
   both are ready) and
   each runs ``--reps`` loads back to back (both read the same hot prefix, as nodes serving one
   popular system prompt do). Reported: aggregate GB/s (all bytes delivered / from the first
   start to the last end) and p50 / p99 of the per-load latency (call to last layer). Baseline:
   one node alone doing the same, in the same run. The page cache is warm: this measures
   decryption and the index, not the disks.

Output: fixed-width min / median / max tables, ratios against the baselines,
``bench/results/fleet.png`` and ``fleet.json`` (``--out DIR``).

Run:  .venv/bin/python bench/fleet.py [--reps 20] [--lookup-tokens 131072] [--load-tokens 2048]
      [--layers 61] [--postgres postgresql+psycopg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _cli import add_postgres, bench_parser, write_outputs
from _common import GB, format_stats_table, print_machine, round_robin_calls
from _fixtures import (
    check_load,
    deepseek_layout,
    load_all,
    lookup_layout,
    open_cache,
    postgres_schema,
    random_layers,
    tenant_namespace,
    torch_tokens,
)
from _plots import median_bars, pyplot, save_figure

HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- #
# 1. Lookup of a 128K-token prompt
# --------------------------------------------------------------------------- #


def measure_lookups(root: Path, database_url: str | None, num_tokens: int, reps: int) -> dict:
    layout = lookup_layout()
    cached, other = torch_tokens(num_tokens, 1), torch_tokens(num_tokens, 2)
    with open_cache(root, database_url, durable=False) as kv:
        ns = tenant_namespace(kv, "acme", layout, model="bench", quota_bytes=2**34)
        stored = ns.store(cached, random_layers(layout, num_tokens, 1))
        assert stored == num_tokens, f"stored {stored} of {num_tokens} tokens"
        assert ns.lookup(cached) == num_tokens and ns.lookup(other) == 0  # checked, untimed
        # round-robin: drifting load hits both alike
        calls = {"hit": lambda: ns.lookup(cached), "miss": lambda: ns.lookup(other)}
        return round_robin_calls(calls, reps)


# --------------------------------------------------------------------------- #
# 2. Two nodes loading at once
# --------------------------------------------------------------------------- #


def node_child(root: str, url: str, num_tokens: int, layers: int, reps: int) -> None:
    """One node (a process of its own): check one load, say ``ready``, wait for the parent's
    ``go`` line (sent once every node is ready), time ``reps`` loads."""
    layout = deepseek_layout(layers)
    tokens = torch_tokens(num_tokens, 7)
    with open_cache(Path(root), url, durable=False) as kv:
        ns = kv.namespace("acme", model="bench", layout=layout)
        check_load(ns, tokens, random_layers(layout, num_tokens, 7))
        print("ready", flush=True)
        sys.stdin.readline()
        spans: list[tuple[float, float]] = []
        for _ in range(reps):
            start = time.time()
            load_all(ns, tokens)
            spans.append((start, time.time()))
    print(json.dumps(spans), flush=True)


def run_nodes(root: Path, url: str, count: int, args: argparse.Namespace) -> dict:
    children = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "fleet.py"),
                "--node-child",
                json.dumps([str(root), url, args.load_tokens, args.layers, args.reps]),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    for child in children:  # every node imported torch, opened its cache, checked a load
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    spans = []
    for child in children:
        out, _ = child.communicate(timeout=600)
        if child.returncode != 0:
            raise SystemExit(f"a node child failed (exit {child.returncode})")
        spans.append(json.loads(out.strip().splitlines()[-1]))
    late = max(s[0][0] for s in spans) - min(s[0][0] for s in spans)
    nbytes = args.load_tokens * args.layers * 576 * 2
    every = [end - start for node in spans for start, end in node]
    wall = max(end for node in spans for _, end in node) - min(s[0][0] for s in spans)
    return {
        "nodes": count,
        "latencies": every,
        "aggregate_gbps": count * args.reps * nbytes / wall / GB,
        "per_load_gbps": [nbytes / s / GB for s in every],
        "start_skew_s": late,  # between the nodes' first loads
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = bench_parser(__doc__, reps=20, layers=61)
    parser.add_argument("--lookup-tokens", type=int, default=131_072)
    parser.add_argument("--load-tokens", type=int, default=2048)
    add_postgres(parser, None)
    parser.add_argument("--skip-lookup", action="store_true")
    parser.add_argument("--skip-nodes", action="store_true")
    parser.add_argument("--node-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node_child:
        node_child(*json.loads(args.node_child))
        return

    print_machine(args.dir)
    report: dict[str, Any] = {"args": vars(args)}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tkv-fleet-") as tmp:
        if not args.skip_lookup:
            print(f"1. lookup of a {args.lookup_tokens:,}-token prompt, {args.reps} reps\n")
            with postgres_schema(args.postgres) as url:
                lookups = {
                    "sqlite": measure_lookups(
                        Path(tmp) / "lk-sqlite", None, args.lookup_tokens, args.reps
                    ),
                    "postgresql": measure_lookups(
                        Path(tmp) / "lk-pg", url, args.lookup_tokens, args.reps
                    ),
                }
            base = statistics.median(lookups["sqlite"]["hit"])
            rows = [
                (
                    f"{index} {kind}",
                    [s * 1e3 for s in seconds],
                    f"{statistics.median(seconds) / base:.2f}x sqlite hit",
                )
                for index, kinds in lookups.items()
                for kind, seconds in kinds.items()
            ]
            print(
                format_stats_table(rows, "ms", label="index / lookup", note_header="median ratio")
            )
            print()
            report["lookup"] = lookups

        if not args.skip_nodes:
            layout = deepseek_layout(args.layers)
            nbytes = args.load_tokens * args.layers * 576 * 2
            print(
                f"2. nodes loading at once: {args.load_tokens:,} tokens x {args.layers} layers "
                f"= {nbytes / 1e6:.1f} MB per load, {args.reps} loads per node, shared directory "
                "+ PostgreSQL\n"
            )
            root = Path(tmp) / "nodes"
            with postgres_schema(args.postgres) as url:
                with open_cache(root, url, durable=False) as kv:
                    ns = tenant_namespace(kv, "acme", layout, model="bench", quota_bytes=2**36)
                    tokens = torch_tokens(args.load_tokens, 7)
                    ns.store(tokens, random_layers(layout, args.load_tokens, 7))
                runs = [run_nodes(root, url, count, args) for count in (1, 2)]
            rows = []
            for run in runs:
                lat = run["latencies"]
                rows.append(
                    (
                        f"{run['nodes']} node(s): per-load latency",
                        [s * 1e3 for s in lat],
                        f"p50 {percentile(lat, 0.5) * 1e3:.1f} ms, "
                        f"p99 {percentile(lat, 0.99) * 1e3:.1f} ms",
                    )
                )
            print(format_stats_table(rows, "ms", label="run", note_header="percentiles"))
            print()
            alone, both = runs
            gain = both["aggregate_gbps"] / alone["aggregate_gbps"]
            p99_ratio = percentile(both["latencies"], 0.99) / percentile(alone["latencies"], 0.99)
            print(
                f"aggregate GB/s: 1 node {alone['aggregate_gbps']:.3f}, 2 nodes "
                f"{both['aggregate_gbps']:.3f} ({gain:.2f}x one node); "
                f"p99 latency 2 nodes / 1 node: {p99_ratio:.2f}x"
            )
            print(f"start skew between the nodes: {both['start_skew_s'] * 1e3:.1f} ms")
            report["nodes"] = runs

    write_outputs(args.out, "fleet", report, lambda png: plot(report, png))


def plot(report: dict[str, Any], path: Path) -> None:
    """Medians with min/max whiskers: lookup ms per index, per-load ms per node count."""
    panels = []
    if "lookup" in report:
        panels.append(
            (
                "lookup of the long prompt (ms)",
                [
                    (f"{index}\n{kind}", [s * 1e3 for s in seconds])
                    for index, kinds in report["lookup"].items()
                    for kind, seconds in kinds.items()
                ],
            )
        )
    if "nodes" in report:
        panels.append(
            (
                "per-load latency (ms)",
                [
                    (f"{run['nodes']} node(s)", [s * 1e3 for s in run["latencies"]])
                    for run in report["nodes"]
                ],
            )
        )
    if not panels:
        return
    fig, axes = pyplot().subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (title, bars) in zip(axes[0], panels, strict=True):
        median_bars(ax, range(len(bars)), [v for _, v in bars], capsize=5, color="#ff7f0e")
        ax.set_xticks(range(len(bars)), [name for name, _ in bars], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
