#!/usr/bin/env python3
"""A load's read plan (issue 16): where a cached prefix's blocks lie, found run by run against
one ``IN``-list probe per key, on SQLite and PostgreSQL, measured round-robin in one run.

For each size (default 8K, 32K and 128K tokens) a prompt is stored in a 1-layer MLA namespace
in 16K-token steps with ``start=`` (as a conversation grows: 128K tokens lie in 8 extents of
256 blocks), then ``--reps`` times, round-robin, each case once:

* ``plan``: ``Namespace._plan``, what a load runs before its first chunk (the blocks run by
  run, their extents, the runs grouped, each extent's cipher);
* ``locate, runs``: its index part alone (``locate_blocks(prefix=True)``): per run one
  statement that finds the run's first key and reads the rest of the run from the index on
  ``(extent_id, slot, namespace_id, block_key)``, then the extents;
* ``locate, IN lists`` (the baseline: the path before): the same blocks probed key by key in
  ``IN`` lists of 500 (``locate_blocks(prefix=False)``), then the extents.

Both locate cases must give the same plan (checked before timing). Ratios are to ``locate, IN
lists`` of the same size, index and run. Output: min / median / max tables,
``bench/results/plan.png`` and ``plan.json`` (``--out DIR``).

Run:  .venv/bin/python bench/plan.py [--reps 30] [--sizes 8192,32768,131072] [--skip-postgres]
      [--postgres postgresql+psycopg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _cli import add_postgres, bench_parser, block_sizes, write_outputs
from _common import format_stats_table, print_machine, round_robin_calls
from _fixtures import lookup_layout, open_cache, postgres_schema, tenant_namespace
from _plots import median_bars, pyplot, save_figure

from tenantkv.index.plan import locate_blocks

STEP_TOKENS = 16_384  # tokens per store: a conversation's turns
BASELINE = "locate, IN lists"


def measure(root: Path, database_url: str | None, num_tokens: int, reps: int) -> dict[str, Any]:
    layout = lookup_layout()
    tokens = np.random.default_rng(num_tokens).integers(0, 50_000, num_tokens).astype(np.uint32)
    kv_rows = torch.zeros(num_tokens, layout.values_per_token, dtype=layout.dtype)
    with open_cache(root, database_url, durable=False) as kv:
        ns = tenant_namespace(kv, "acme", layout, model="bench", quota_bytes=2**34)
        for start in range(0, num_tokens, STEP_TOKENS):
            end = min(start + STEP_TOKENS, num_tokens)
            ns.store(tokens[:end], [kv_rows[start:end]], start=start)
        keys = ns._keys(tokens)
        identity, index, clock = ns.identity, kv.context.index, kv.context.clock

        def locate(prefix: bool) -> Any:
            with index.read_connection() as connection:
                return locate_blocks(
                    connection,
                    tenant_id=identity.tenant_id,
                    namespace_id=identity.namespace_id,
                    keys=keys,
                    now=clock(),
                    prefix=prefix,
                )

        def plan() -> Any:
            with index.read_connection() as connection:
                return ns._plan(connection, keys)

        cases: dict[str, Callable[[], Any]] = {
            "plan": plan,
            "locate, runs": lambda: locate(True),
            BASELINE: lambda: locate(False),
        }
        runs, probed = locate(True), locate(False)  # checked, untimed (and warms up)
        assert runs == probed and len(runs[0]) == len(keys), "the two plans differ"
        extents = len(runs[1])
        assert plan().num_blocks == len(keys)
        timings = round_robin_calls(cases, reps, freeze=True)
    return {"timings": timings, "extents": extents, "blocks": len(keys)}


def report_table(label: str, run: dict[str, Any]) -> str:
    timings = run["timings"]
    base = statistics.median(timings[BASELINE])
    rows = [
        (name, [s * 1e3 for s in seconds], f"{statistics.median(seconds) / base:5.2f}x")
        for name, seconds in timings.items()
    ]
    title = f"{label} ({run['blocks']:,} blocks, {run['extents']} extents)"
    return format_stats_table(rows, "ms", label=title, digits=3, note_header="vs IN lists")


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    indexes = list(report["runs"])
    fig, axes = plt.subplots(1, len(indexes), figsize=(7 * len(indexes), 5), squeeze=False)
    for ax, index in zip(axes[0], indexes, strict=True):
        sizes = list(report["runs"][index])
        names = list(report["runs"][index][sizes[0]]["timings"])
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            values = [
                [s * 1e3 for s in report["runs"][index][size]["timings"][name]] for size in sizes
            ]
            median_bars(
                ax,
                [x + i * width for x in range(len(sizes))],
                values,
                width,
                label=name,
                color="#999999" if name == BASELINE else None,
            )
        ax.set_xticks(
            [x + width * (len(names) - 1) / 2 for x in range(len(sizes))],
            [f"{int(size):,} tokens" for size in sizes],
        )
        ax.set_ylabel("ms (median, min-max whiskers)")
        ax.set_title(f"read plan of a cached prefix, {index}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = bench_parser(__doc__, reps=30, data_dir=False)
    parser.add_argument("--sizes", type=block_sizes, default="8192,32768,131072")
    add_postgres(parser)
    args = parser.parse_args()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tkv-bench-plan-") as tmp:
        print_machine(tmp)
        print(f"\nread plan of a cached prefix, {args.reps} reps, round-robin; ms\n")
        indexes = ["sqlite"] + ([] if args.skip_postgres else ["postgresql"])
        for name in indexes:
            runs[name] = {}
            for size in args.sizes:
                root = Path(tmp) / f"{name}-{size}"
                if name == "sqlite":
                    run = measure(root, None, size, args.reps)
                else:
                    with postgres_schema(args.postgres) as url:
                        run = measure(root, url, size, args.reps)
                runs[name][str(size)] = run
                print(report_table(f"{name}, {size:,} tokens", run) + "\n")
    report = {"reps": args.reps, "runs": runs}
    write_outputs(args.out, "plan", report, lambda png: plot(report, png))


if __name__ == "__main__":
    main()
