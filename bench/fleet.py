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
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import GB, format_stats_table, machine_info, print_kv

import tenantkv
from tenantkv import KVLayout

HERE = Path(__file__).resolve().parent
DEFAULT_POSTGRES = os.environ.get(
    "TENANTKV_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
LOOKUP_LAYOUT = KVLayout.mla(num_layers=1, kv_lora_rank=32, rope_dim=8, dtype=torch.bfloat16)


def deepseek_layout(layers: int) -> KVLayout:
    return KVLayout.mla(num_layers=layers, kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)


def tokens_of(num_tokens: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (num_tokens,), generator=generator).tolist()


def layers_of(layout: KVLayout, num_tokens: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = layout.kv_lora_rank + layout.rope_dim
    return [
        torch.randn(num_tokens, width, generator=generator).to(layout.dtype)
        for _ in range(layout.num_layers)
    ]


class PostgresSchema:
    """A schema of its own on the server, for one run; dropped by :meth:`drop`."""

    def __init__(self, base_url: str) -> None:
        from sqlalchemy import create_engine

        self.base_url = base_url
        self.name = f"tkv_bench_{secrets.token_hex(4)}"
        self._engine = create_engine(base_url, pool_size=1, max_overflow=0)
        with self._engine.begin() as connection:
            connection.exec_driver_sql(f"CREATE SCHEMA {self.name}")

    @property
    def url(self) -> str:
        sep = "&" if "?" in self.base_url else "?"
        return f"{self.base_url}{sep}options=-csearch_path%3D{self.name}"

    def drop(self) -> None:
        with self._engine.begin() as connection:
            connection.exec_driver_sql(f"DROP SCHEMA IF EXISTS {self.name} CASCADE")
        self._engine.dispose()


# --------------------------------------------------------------------------- #
# 1. Lookup of a 128K-token prompt
# --------------------------------------------------------------------------- #


def measure_lookups(root: Path, database_url: str | None, num_tokens: int, reps: int) -> dict:
    settings: dict[str, Any] = {"durable": False}
    if database_url is not None:
        settings["database_url"] = database_url
    cached, other = tokens_of(num_tokens, 1), tokens_of(num_tokens, 2)
    with tenantkv.open(root, **settings) as kv:
        kv.create_tenant("acme", quota_bytes=2**34)
        ns = kv.namespace("acme", model="bench", layout=LOOKUP_LAYOUT)
        stored = ns.store(cached, layers_of(LOOKUP_LAYOUT, num_tokens, 1))
        assert stored == num_tokens, f"stored {stored} of {num_tokens} tokens"
        assert ns.lookup(cached) == num_tokens and ns.lookup(other) == 0  # checked, untimed
        timings: dict[str, list[float]] = {"hit": [], "miss": []}
        for _ in range(reps):  # round-robin: drifting load hits both alike
            for name, tokens in (("hit", cached), ("miss", other)):
                start = time.perf_counter()
                ns.lookup(tokens)
                timings[name].append(time.perf_counter() - start)
    return timings


# --------------------------------------------------------------------------- #
# 2. Two nodes loading at once
# --------------------------------------------------------------------------- #


def node_child(root: str, url: str, num_tokens: int, layers: int, reps: int) -> None:
    """One node (a process of its own): check one load, say ``ready``, wait for the parent's
    ``go`` line (sent once every node is ready), time ``reps`` loads."""
    layout = deepseek_layout(layers)
    tokens = tokens_of(num_tokens, 7)
    with tenantkv.open(Path(root), durable=False, database_url=url) as kv:
        ns = kv.namespace("acme", model="bench", layout=layout)
        expected = layers_of(layout, num_tokens, 7)
        with ns.load(tokens) as stream:
            exact = all(
                torch.equal(stream.wait_for_layer(i), want) for i, want in enumerate(expected)
            )
        assert exact, "a load returned other bytes than were stored"
        del expected
        print("ready", flush=True)
        sys.stdin.readline()
        spans: list[tuple[float, float]] = []
        for _ in range(reps):
            start = time.time()
            with ns.load(tokens) as stream:
                for _index, _layer in stream:
                    pass
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--lookup-tokens", type=int, default=131_072)
    parser.add_argument("--load-tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--postgres", default=DEFAULT_POSTGRES)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--skip-lookup", action="store_true")
    parser.add_argument("--skip-nodes", action="store_true")
    parser.add_argument("--node-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node_child:
        node_child(*json.loads(args.node_child))
        return

    print_kv("machine", machine_info(args.dir))
    report: dict[str, Any] = {"args": vars(args)}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tkv-fleet-") as tmp:
        if not args.skip_lookup:
            print(f"1. lookup of a {args.lookup_tokens:,}-token prompt, {args.reps} reps\n")
            schema = PostgresSchema(args.postgres)
            try:
                lookups = {
                    "sqlite": measure_lookups(
                        Path(tmp) / "lk-sqlite", None, args.lookup_tokens, args.reps
                    ),
                    "postgresql": measure_lookups(
                        Path(tmp) / "lk-pg", schema.url, args.lookup_tokens, args.reps
                    ),
                }
            finally:
                schema.drop()
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
            schema = PostgresSchema(args.postgres)
            root = Path(tmp) / "nodes"
            try:
                with tenantkv.open(root, durable=False, database_url=schema.url) as kv:
                    kv.create_tenant("acme", quota_bytes=2**36)
                    ns = kv.namespace("acme", model="bench", layout=layout)
                    ns.store(tokens_of(args.load_tokens, 7), layers_of(layout, args.load_tokens, 7))
                runs = [run_nodes(root, schema.url, count, args) for count in (1, 2)]
            finally:
                schema.drop()
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

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "fleet.png")
    print(f"\nwrote {out / 'fleet.json'} and {out / 'fleet.png'}")


def plot(report: dict[str, Any], path: Path) -> None:
    """Medians with min/max whiskers: lookup ms per index, per-load ms per node count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (title, bars) in zip(axes[0], panels, strict=True):
        medians = [statistics.median(v) for _, v in bars]
        errors = [
            [m - min(v) for m, (_, v) in zip(medians, bars, strict=True)],
            [max(v) - m for m, (_, v) in zip(medians, bars, strict=True)],
        ]
        ax.bar(
            range(len(bars)), medians, yerr=errors, capsize=5, color="#ff7f0e", edgecolor="black"
        )
        ax.set_xticks(range(len(bars)), [name for name, _ in bars], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
