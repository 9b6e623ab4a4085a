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

import argparse
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import format_stats_table, machine_info, median_bars, print_kv
from fleet import DEFAULT_POSTGRES, LOOKUP_LAYOUT, PostgresSchema

import tenantkv
from tenantkv.index.plan import locate_blocks

HERE = Path(__file__).resolve().parent
STEP_TOKENS = 16_384  # tokens per store: a conversation's turns
BASELINE = "locate, IN lists"


def measure(root: Path, database_url: str | None, num_tokens: int, reps: int) -> dict[str, Any]:
    settings: dict[str, Any] = {"durable": False}
    if database_url is not None:
        settings["database_url"] = database_url
    tokens = np.random.default_rng(num_tokens).integers(0, 50_000, num_tokens).astype(np.uint32)
    width = LOOKUP_LAYOUT.kv_lora_rank + LOOKUP_LAYOUT.rope_dim
    kv_rows = torch.zeros(num_tokens, width, dtype=LOOKUP_LAYOUT.dtype)
    with tenantkv.open(root, **settings) as kv:
        kv.create_tenant("acme", quota_bytes=2**34)
        ns = kv.namespace("acme", model="bench", layout=LOOKUP_LAYOUT)
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
        timings: dict[str, list[float]] = {name: [] for name in cases}
        gc.collect()
        gc.freeze()
        for _ in range(reps):
            for name, run in cases.items():
                started = time.perf_counter()
                run()
                timings[name].append(time.perf_counter() - started)
        gc.unfreeze()
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--sizes", default="8192,32768,131072")
    parser.add_argument("--postgres", default=DEFAULT_POSTGRES)
    parser.add_argument("--skip-postgres", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    if any(size < 64 or size % 64 for size in sizes):
        parser.error("--sizes must be multiples of 64 tokens")

    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tkv-bench-plan-") as tmp:
        print_kv("machine", machine_info(tmp))
        print(f"\nread plan of a cached prefix, {args.reps} reps, round-robin; ms\n")
        indexes: list[tuple[str, Callable[[], str | None], Callable[[], None]]] = [
            ("sqlite", lambda: None, lambda: None)
        ]
        if not args.skip_postgres:
            schemas: list[PostgresSchema] = []

            def new_schema() -> str:
                schemas.append(PostgresSchema(args.postgres))
                return schemas[-1].url

            def drop_schemas() -> None:
                for schema in schemas:
                    schema.drop()

            indexes.append(("postgresql", new_schema, drop_schemas))
        for name, url_for_run, cleanup in indexes:
            runs[name] = {}
            try:
                for size in sizes:
                    root = Path(tmp) / f"{name}-{size}"
                    runs[name][str(size)] = measure(root, url_for_run(), size, args.reps)
                    print(report_table(f"{name}, {size:,} tokens", runs[name][str(size)]) + "\n")
            finally:
                cleanup()
    report = {"reps": args.reps, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "plan.png")
    print(f"wrote {out / 'plan.json'} and {out / 'plan.png'}")


if __name__ == "__main__":
    main()
