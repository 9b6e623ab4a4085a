#!/usr/bin/env python3
"""Lookup of a long prompt (issue 16): tenantkv's ``Namespace.lookup`` on SQLite and PostgreSQL,
with its parts and its baselines, measured round-robin in one run.

A prompt of ``--tokens`` tokens (default 131,072 = 128K = 2,048 blocks of 64) is stored once in
a 1-layer MLA namespace (a lookup reads only the index: the KV's size does not matter). Then,
``--reps`` times, round-robin (drifting load hits every case alike), each case once:

* ``hit``: ``ns.lookup`` of the cached prompt, tokens as a numpy array (what an engine holds as
  a tensor); ``hit, list``: the same prompt as a Python list of ints (what the issue's figures
  used; the list's conversion to an array, by `tenantkv/_token_ids.c`, is part of it);
* ``hit, structure cold``: the node's held keys of the namespace dropped first (untimed), as
  after a removal in the namespace or on a node's first lookup: the index is asked for every key;
* ``hit, before`` (the old path, kept reachable for this comparison): the prompt's keys, then
  every key asked of the index in ``IN`` lists of 500 (``index.blocks.present_keys``), as every
  lookup did before the node-local structure (metering aside);
* ``partial``: a prompt whose first half is cached and second half new (a hit of half);
* ``miss``: a prompt of the same length, nothing cached;
* parts of ``hit``: ``keys`` (the keyed BLAKE2b chain, ``Namespace._keys``: the C chain of
  ``tenantkv/_prefix_chain.c`` where the install built it) and ``index`` (the held keys plus
  the one statement, ``Namespace._cached_blocks``);
* ``keys, hashlib loop``: the same keys through ``prefix.block_keys_python``, the loop the C
  chain replaced (and what runs where no C compiler was at hand);
* baselines with no index at all: ``sha256 chain`` (an unkeyed SHA-256 chain over the same
  bytes: the cheapest chained hash in the standard library) and ``vLLM-style sha256(pickle)
  chain`` (``sha256(pickle.dumps((parent, tuple(block))))`` per block, as vLLM's prefix caching
  hashes blocks; tokens from the list).

Before timing, ``gc.freeze()`` moves every object made so far (torch, SQLAlchemy, the
prompts) out of the collector's reach, so that a collection triggered inside a timed call
(the pickle baseline makes 2,048 tuples per call) walks only new objects, as a long-running
server that freezes after start-up does.
Ratios are to the ``hit`` median of the same index and run. Output: fixed-width min / median /
max tables, ``bench/results/lookup.png`` and ``lookup.json`` (``--out DIR``).

Run:  .venv/bin/python bench/lookup.py [--reps 30] [--tokens 131072] [--skip-postgres]
      [--postgres postgresql+psycopg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import hashlib
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _cli import add_postgres, bench_parser, write_outputs
from _common import format_stats_table, print_machine, round_robin_calls
from _fixtures import (
    DTYPE,
    lookup_layout,
    open_cache,
    postgres_schema,
    tenant_namespace,
    vllm_style_chain,
)
from _plots import median_bars, pyplot, save_figure

from tenantkv.index import blocks
from tenantkv.prefix import block_keys_python


def sha256_chain(data: bytes, step: int) -> list[bytes]:
    previous = b"\0" * 32
    keys = []
    for start in range(0, len(data) // step * step, step):
        previous = hashlib.sha256(previous + data[start : start + step]).digest()
        keys.append(previous)
    return keys


def measure(root: Path, database_url: str | None, num_tokens: int, reps: int) -> dict[str, Any]:
    layout = lookup_layout()
    rng = np.random.default_rng(16)
    cached = rng.integers(0, 50_000, num_tokens).astype(np.uint32)
    fresh = rng.integers(0, 50_000, num_tokens).astype(np.uint32)
    half = num_tokens // 2 // 64 * 64
    partial = np.concatenate([cached[:half], fresh[: num_tokens - half]])
    cached_list = cached.tolist()
    with open_cache(root, database_url, durable=False) as kv:
        ns = tenant_namespace(kv, "acme", layout, model="bench", quota_bytes=2**34)
        stored = ns.store(cached, [torch.zeros(num_tokens, layout.values_per_token, dtype=DTYPE)])
        assert stored == num_tokens, f"stored {stored} of {num_tokens} tokens"
        ctx = kv.context
        namespace_id = ns.identity.namespace_id
        keys = ns._keys(cached)

        def before() -> int:
            """The lookup of before the node-local structure (metering aside)."""
            keys = ns._keys(cached)
            with ctx.index.read() as session:
                present = blocks.present_keys(
                    session, namespace_id, keys, ctx.clock(), stop_at_gap=True
                )
            return ns._run_from_zero(keys, present) * ns.block_tokens

        def drop_held() -> None:
            ctx.lookups.forget(namespace_id)

        data = cached.astype("<u4").tobytes()
        # name -> (untimed setup before each run, the timed call, its expected answer)
        cases: dict[str, tuple[Callable[[], None] | None, Callable[[], Any], Any]] = {
            "hit": (None, lambda: ns.lookup(cached), num_tokens),
            "hit, list": (None, lambda: ns.lookup(cached_list), num_tokens),
            "hit, structure cold": (drop_held, lambda: ns.lookup(cached), num_tokens),
            "hit, before": (None, before, num_tokens),
            "partial": (None, lambda: ns.lookup(partial), half),
            "miss": (None, lambda: ns.lookup(fresh), 0),
            "hit: keys": (None, lambda: ns._keys(cached), None),
            "hit: index": (None, lambda: ns._cached_blocks(keys), num_tokens // 64),
            "keys, hashlib loop (no C chain)": (
                None,
                lambda: block_keys_python(ns._hash_key, ns.identity.fingerprint, cached),
                keys,
            ),
            "sha256 chain": (None, lambda: sha256_chain(data, 256), None),
            "vLLM-style sha256(pickle) chain": (
                None,
                lambda: vllm_style_chain(cached_list, 64),
                None,
            ),
        }
        for name, (setup, run, expected) in cases.items():  # checked, untimed (and warms up)
            if setup is not None:
                setup()
            got = run()
            if expected is not None:
                assert got == expected, f"{name}: {got} != {expected}"
        # The objects made so far (torch, SQLAlchemy, the prompts) move to the permanent
        # generation: a collection triggered inside a timed call then walks only new objects.
        timings = round_robin_calls(
            {name: run for name, (_setup, run, _expected) in cases.items()},
            reps,
            setup={name: setup for name, (setup, _run, _) in cases.items() if setup is not None},
            freeze=True,
        )
        held = ctx.lookups.size()
    return {"timings": timings, "held": held}


def report_table(index: str, timings: dict[str, list[float]]) -> str:
    base = statistics.median(timings["hit"])
    before = statistics.median(timings["hit, before"])
    rows = []
    for name, seconds in timings.items():
        median = statistics.median(seconds)
        note = f"{median / base:5.2f}x"
        if name == "hit":
            note += f"  ({before / median:.1f}x faster than before)"
        rows.append((name, [s * 1e3 for s in seconds], note))
    return format_stats_table(rows, "ms", label=f"{index}", digits=3, note_header="vs hit")


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    indexes = list(report["runs"])
    fig, axes = plt.subplots(1, len(indexes), figsize=(7 * len(indexes), 5), squeeze=False)
    for ax, index in zip(axes[0], indexes, strict=True):
        timings = report["runs"][index]["timings"]
        names = list(timings)
        colors = [
            "#1f77b4" if not n.startswith(("sha256", "vLLM", "hit, before")) else "#999999"
            for n in names
        ]
        median_bars(
            ax,
            range(len(names)),
            [[s * 1e3 for s in timings[name]] for name in names],
            horizontal=True,
            color=colors,
        )
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.axvline(2.0, color="red", linestyle="--", linewidth=1, label="2 ms target")
        ax.set_xlabel("ms (median, min-max whiskers; log scale)")
        ax.set_title(f"{report['tokens']:,}-token lookup, {index}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = bench_parser(__doc__, reps=30, data_dir=False)
    parser.add_argument("--tokens", type=int, default=131_072)
    add_postgres(parser)
    args = parser.parse_args()
    if args.tokens < 128 or args.tokens % 64:
        parser.error("--tokens must be a multiple of 64, at least 128")

    with tempfile.TemporaryDirectory(prefix="tkv-bench-lookup-") as tmp:
        print_machine(tmp)
        print(
            f"\nlookup of a {args.tokens:,}-token prompt ({args.tokens // 64:,} blocks), "
            f"{args.reps} reps, round-robin; ms\n"
        )
        runs: dict[str, Any] = {
            "sqlite": measure(Path(tmp) / "sqlite", None, args.tokens, args.reps)
        }
        print(report_table("sqlite", runs["sqlite"]["timings"]) + "\n")
        if not args.skip_postgres:
            with postgres_schema(args.postgres) as url:
                runs["postgresql"] = measure(Path(tmp) / "pg", url, args.tokens, args.reps)
            print(report_table("postgresql", runs["postgresql"]["timings"]) + "\n")
    report = {"tokens": args.tokens, "reps": args.reps, "runs": runs}
    write_outputs(args.out, "lookup", report, lambda png: plot(report, png))


if __name__ == "__main__":
    main()
