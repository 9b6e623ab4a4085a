#!/usr/bin/env python3
"""Load throughput of one prefix from each block-store tier: a directory, Redis, and Redis in
front of the directory (hot hit and cold read-through).

One 61-layer DeepSeek-V3-shaped prefix (MLA: 576 bf16 values = 1,152 B per token per layer;
``--tokens`` default 8,192 = 575.7 MB) is stored once, untimed, in three caches that share
nothing but the Redis server: ``file:///<dir>``, ``redis://...?prefix=<random>`` and the tiered
``redis://...?prefix=<random>,file:///<dir>``. Every method is checked once, untimed, to load
exactly the stored bytes; then the loads are timed in ``--reps`` round-robin rounds (one rep of
each method per round, so drifting machine load hits all methods alike):

* file tier -- the baseline: ``LocalBlockStore``, page cache warm;
* redis raw read -- the ceiling of the Redis tier: the same stored bytes read with pipelined
  1 MiB GETRANGEs, with no decryption and no cache around them;
* redis tier -- ``RedisBlockStore`` (pipelined 1 MiB GETRANGEs per read, over TCP to 127.0.0.1);
* tiered, hot hit -- the extent is in Redis; the directory is not read;
* tiered, cold read-through -- before each rep (untimed) the extent's Redis keys are deleted,
  so the load misses the hot tier, reads the directory, and promotes the extent back into
  Redis in the background (the promotion is waited for untimed after the rep).

A load is ``with ns.load(tokens) as s: for i, layer in s: pass`` from the call to the last
layer. Throughput is plaintext bytes / second (1 GB = 1e9 B). Ratios of medians against the
file tier, measured in the same run. The Redis keys (under random prefixes) and the data
directory are removed at the end.

Run:  .venv/bin/python bench/tiers.py [--tokens 8192] [--reps 5] [--layers 61]
      [--redis redis://127.0.0.1:6379/0] [--dir /tmp] [--out bench/results]
"""

from __future__ import annotations

import argparse
import random
import secrets
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis
from _cli import bench_parser, write_outputs
from _common import Hook, Result, format_table, print_machine, round_robin, stopwatch
from _fixtures import (
    check_load,
    deepseek_layout,
    load_all,
    random_layers,
    random_tokens,
    tenant_namespace,
)
from _plots import plot_results

import tenantkv
from tenantkv.storage import TieredBlockStore


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__, reps=5, layers=61, seed=0)
    p.add_argument("--tokens", type=int, default=8192, help="prefix length (multiple of 64)")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="the Redis server")
    return p.parse_args(argv)


def raw_read(client: Any, prefix: str, piece: int = 2**20) -> int:
    """Read every chunk key under ``prefix`` with pipelined GETRANGEs of ``piece`` bytes;
    the byte count read."""
    total = 0
    for key in client.scan_iter(match=prefix + "*:*", count=1000):
        size = client.strlen(key)
        pipe = client.pipeline(transaction=False)
        for start in range(0, size, piece):
            pipe.getrange(key, start, min(start + piece, size) - 1)
        total += sum(len(part) for part in pipe.execute())
    return total


def drop_keys(client: Any, prefix: str) -> None:
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tenantkv-tiers-", dir=args.dir))
    client = redis.Redis.from_url(args.redis)
    prefixes = {name: f"tkvbench:{secrets.token_hex(4)}:" for name in ("redis", "tiered")}
    tokens = random_tokens(random.Random(args.seed), args.tokens)
    layout = deepseek_layout(args.layers)
    nbytes = args.tokens * args.layers * layout.values_per_token * layout.dtype.itemsize
    server = client.info("server")["redis_version"]
    info = print_machine(work, redis=f"{args.redis} (server {server})")
    print(f"prefix: {args.tokens} tokens x {args.layers} layers = {nbytes / 1e6:.1f} MB\n")
    urls = {
        "file": (work / "file").as_uri(),
        "redis": f"{args.redis}?prefix={prefixes['redis']}",
        "tiered": f"{args.redis}?prefix={prefixes['tiered']},{(work / 'cold').as_uri()}",
    }
    caches: dict[str, Any] = {}
    try:
        data = random_layers(layout, args.tokens, args.seed)
        namespaces = {}
        for name, url in urls.items():
            kv = tenantkv.open(work / f"cache-{name}", durable=False, block_store_url=url)
            caches[name] = kv
            ns = tenant_namespace(kv, "bench", layout)
            assert ns.store(tokens, data) == args.tokens, f"{name}: store was skipped"
            namespaces[name] = ns
        tiered = caches["tiered"]._ctx.blocks
        assert isinstance(tiered, TieredBlockStore)

        def to_cold(_: int) -> None:
            drop_keys(client, prefixes["tiered"])

        def settle(_: int) -> None:
            tiered.wait_for_promotions()

        # stored ciphertext: the payload plus a few headers and tags per layer
        stored = raw_read(client, prefixes["redis"])
        assert nbytes <= stored < 1.01 * nbytes, f"raw read found {stored} bytes"

        def read_raw() -> None:
            raw_read(client, prefixes["redis"])

        # (name, the namespace it loads from or None for the raw read, before, after)
        methods: list[tuple[str, Any, Hook | None, Hook | None]] = [
            ("file tier", namespaces["file"], None, None),
            ("redis raw read", None, None, None),
            ("redis tier", namespaces["redis"], None, None),
            ("tiered, hot hit", namespaces["tiered"], settle, None),
            ("tiered, cold read-through", namespaces["tiered"], to_cold, settle),
        ]
        for _name, ns, before, after in methods:  # correctness, untimed
            if ns is None:
                continue
            if before:
                before(0)
            check_load(ns, tokens, data)
            if after:
                after(0)
        del data

        def timed(ns: Any) -> Callable[[int], float]:
            if ns is None:
                return stopwatch(lambda _: read_raw())
            return stopwatch(lambda _: load_all(ns, tokens))

        seconds = round_robin(
            {name: timed(ns) for name, ns, _before, _after in methods},
            args.reps,
            before={name: before for name, _ns, before, _after in methods},
            after={name: after for name, _ns, _before, after in methods},
        )
        stats = tiered.stats()
    finally:
        for kv in caches.values():
            kv.close()
        for prefix in prefixes.values():
            drop_keys(client, prefix)
        client.close()
        shutil.rmtree(work, ignore_errors=True)
    results = [Result(name, "tenantkv", None, nbytes, seconds[name]) for name in seconds]
    print(format_table(results))
    base = results[0].median_gbps
    print("\nratios of medians (same run):")
    for r in results[1:]:
        print(f"  {r.name} / file tier: {r.median_gbps / base:.2f}")
    ceiling = next(r for r in results if r.name == "redis raw read").median_gbps
    print(f"  redis tier / redis raw read: {results[2].median_gbps / ceiling:.2f}")
    print(f"\ntiered store counters: {stats}")
    summary = {
        "machine": info,
        "tokens": args.tokens,
        "layers": args.layers,
        "results": [r.as_dict() for r in results],
        "ratios": {r.name: r.median_gbps / base for r in results[1:]},
        "tiered_stats": stats,
        "median_gbps": {r.name: statistics.median(r.gbps) for r in results},
    }
    title = f"load of {nbytes / 1e6:.0f} MB by tier"
    write_outputs(args.out, "tiers", summary, lambda png: plot_results(results, png, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
