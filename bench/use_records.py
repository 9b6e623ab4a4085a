#!/usr/bin/env python3
"""Records of use under many small loads (issue 16): written in batches (the default) against
one write transaction per load (the baseline: the path before ``tenantkv.components.use_records``).

Every load's use is an index write after the load closes, on the cache's one bookkeeping
thread. Small loads (a 64-token, one-layer DeepSeek-V3 shaped MLA prefix: 72 KiB) from
``--threads`` threads arrive faster than one transaction per load commits on PostgreSQL, so
the backlog of loads whose use is not yet written grows for as long as they come. For each
index (SQLite in the cache's directory, and a schema of its own on ``--postgres``) and each
workload (one prefix again and again; ``--prefixes`` prefixes in turn, so every load's extent
is another; one prefix in each of ``--tenants`` tenants in turn, a transaction per tenant in
a batch), each case loads for ``--seconds``, ``--rounds`` times, the cases alternating.

Output: min / median / max of loads per second (per ``--window`` of a run), of the backlog
(loads recorded but not yet written, sampled every 50 ms) and of the time from the last
load's end to the last record written (the drain); ratios of medians to the baseline of the
same run; ``bench/results/use_records.png`` and ``use_records.json`` (``--out``).

Run:  .venv/bin/python bench/use_records.py [--seconds 3] [--rounds 3] [--threads 4]
      [--prefixes 64] [--tenants 16] [--postgres postgresql+psycopg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _cli import add_postgres, bench_parser, finish_ab
from _common import format_stats_table, print_machine
from _fixtures import deepseek_layout, load_all, open_cache, postgres_schema, random_layers
from _plots import median_bars, pyplot, save_figure

import tenantkv
from tenantkv.components.use_records import UseRecords

TOKENS = 64  # one block
LAYOUT = deepseek_layout(1)
BASELINE = "a transaction per load (before)"
BATCHED = "batched"
SAMPLE_S = 0.05  # backlog samples
POLL_S = 0.002  # how often the end of loads and of the backlog is checked


def per_load(kv: tenantkv.TenantKV) -> None:
    """Make ``kv`` write each load's use in a transaction of its own, as before batching, on
    the same bookkeeping thread; its counters still count loads recorded and written."""
    ctx = kv.context
    uses = ctx.uses
    counting = threading.Lock()  # loads close on several threads

    def record(tenant_id: bytes, extent_ids: Any, used_at: float) -> None:
        single = UseRecords(ctx.index, ctx.blocks, ctx.remover, submit=lambda task: None)
        single.record(tenant_id, extent_ids, used_at)
        with counting:
            uses.recorded += 1

        def write() -> None:
            single.flush()
            with counting:
                uses.written += single.written
                uses.failed += single.failed

        ctx.runtime.submit_background(write)

    uses.record = record  # type: ignore[method-assign]


def run_case(
    kv: tenantkv.TenantKV,
    prefixes: list[tuple[tenantkv.Namespace, list[int]]],
    threads: int,
    seconds: float,
    window: float,
) -> dict[str, list[float]]:
    uses = kv.context.uses
    done: list[float] = []  # completion times of loads
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def loader(offset: int) -> None:
        turn = offset
        while time.monotonic() < stop:
            ns, tokens = prefixes[turn % len(prefixes)]
            load_all(ns, tokens)
            turn += threads
            with lock:
                done.append(time.monotonic())

    start = time.monotonic()
    workers = [threading.Thread(target=loader, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    backlog: list[float] = []
    sampled = 0.0
    while any(worker.is_alive() for worker in workers):
        now = time.monotonic()
        if now - sampled >= SAMPLE_S:
            backlog.append(uses.recorded - uses.written - uses.failed)
            sampled = now
        time.sleep(POLL_S)
    for worker in workers:
        worker.join()
    while uses.recorded - uses.written - uses.failed > 0:
        time.sleep(POLL_S)
        if time.monotonic() - done[-1] > 120:
            raise RuntimeError("the backlog did not drain in 120 s")
    drain = time.monotonic() - max(done)  # from the last load's end to its use written
    windows = int(seconds / window)
    rates = [
        sum(start + i * window <= t < start + (i + 1) * window for t in done) / window
        for i in range(windows)
    ]
    return {"loads/s": rates, "backlog": backlog, "drain ms": [drain * 1e3]}


def measure(
    root: Path,
    database_url: str | None,
    args: argparse.Namespace,
) -> dict[str, dict[str, dict[str, list[float]]]]:
    workloads = {
        "one prefix": 1,
        f"{args.prefixes} prefixes in turn": args.prefixes,
        f"{args.tenants} tenants in turn": args.tenants,
    }
    results: dict[str, dict[str, dict[str, list[float]]]] = {
        workload: {case: {} for case in (BASELINE, BATCHED)} for workload in workloads
    }
    generator = torch.Generator().manual_seed(1)
    with open_cache(root, database_url, durable=False) as kv:
        namespaces = []
        for tenant in range(args.tenants):
            kv.create_tenant(f"bench-{tenant}", quota_bytes=2**32)
            namespaces.append(kv.namespace(f"bench-{tenant}", model="m", layout=LAYOUT))
        stored: dict[str, list[tuple[tenantkv.Namespace, list[int]]]] = {}
        for number, (workload, count) in enumerate(workloads.items()):
            stored[workload] = []
            for seed in range(number * 1_000, number * 1_000 + count):
                # The tenants' workload: one prefix in each; the others in the first tenant.
                ns = namespaces[seed % 1_000] if "tenants" in workload else namespaces[0]
                tokens = [seed * TOKENS + i for i in range(TOKENS)]
                assert ns.store(tokens, random_layers(LAYOUT, TOKENS, generator)) == TOKENS
                stored[workload].append((ns, tokens))
        batched_record = kv.context.uses.record
        for round_index in range(args.rounds):
            for workload in workloads:
                cases = [BASELINE, BATCHED] if round_index % 2 == 0 else [BATCHED, BASELINE]
                for case in cases:
                    if case == BASELINE:
                        per_load(kv)
                    else:
                        kv.context.uses.record = batched_record  # type: ignore[method-assign]
                    measured = run_case(
                        kv, stored[workload], args.threads, args.seconds, args.window
                    )
                    for part, values in measured.items():
                        results[workload][case].setdefault(part, []).extend(values)
            print(f"  round {round_index + 1}/{args.rounds}", flush=True)
    return results


def report(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    verdicts: dict[str, dict[str, float]] = {}
    for index, workloads in results.items():
        for workload, cases in workloads.items():
            label = f"{index}, {workload}"
            rows = []
            for case, parts in cases.items():
                for part, values in parts.items():
                    base = statistics.median(cases[BASELINE][part])
                    mine = statistics.median(values)
                    note = f"{mine / base:.3f}x" if base else "-"
                    rows.append((f"{case}: {part}", values, note))
            print(f"\n{label}")
            print(format_stats_table(rows, "", label="case: metric", note_header="/ before"))
            verdicts[label] = {
                part: statistics.median(cases[BATCHED][part])
                / max(statistics.median(cases[BASELINE][part]), 1e-9)
                for part in ("loads/s", "backlog", "drain ms")
            }
    return verdicts


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    labels = [(index, workload) for index, workloads in results.items() for workload in workloads]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.38
    for ax, part, unit in ((axes[0], "loads/s", "loads per second"), (axes[1], "backlog", "loads")):
        for i, case in enumerate((BASELINE, BATCHED)):
            samples = [results[index][workload][case][part] for index, workload in labels]
            median_bars(
                ax,
                [x + i * width for x in range(len(labels))],
                samples,
                width,
                label=case,
                color="#999999" if case == BASELINE else None,
            )
        ax.set_xticks(
            [x + width / 2 for x in range(len(labels))],
            [f"{index}\n{workload}" for index, workload in labels],
            fontsize=8,
        )
        ax.set_ylabel(f"{unit} (median, min-max)")
        ax.set_title(part)
        ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def main() -> None:
    parser = bench_parser(__doc__, data_dir=False)
    parser.add_argument("--threads", type=int, default=4, help="loading threads")
    parser.add_argument("--seconds", type=float, default=3.0, help="loading time per case run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=64)
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--window", type=float, default=0.25, help="seconds per loads/s sample")
    add_postgres(parser, "--no-postgres")
    args = parser.parse_args()
    print_machine(tempfile.gettempdir())
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tkv-uses-") as root:
        print("SQLite", flush=True)
        results["SQLite"] = measure(Path(root) / "sqlite", None, args)
    if not args.no_postgres:
        with (
            postgres_schema(args.postgres) as url,
            tempfile.TemporaryDirectory(prefix="tkv-uses-") as root,
        ):
            print("PostgreSQL", flush=True)
            results["PostgreSQL"] = measure(Path(root) / "pg", url, args)
    verdicts = report(results)
    finish_ab(
        "Medians, batched / before (loads/s above 1: more; backlog below 1: shorter):",
        verdicts,
        args.out,
        "use_records",
        lambda path: plot(results, path),
        results,
    )


if __name__ == "__main__":
    main()
