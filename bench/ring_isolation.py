#!/usr/bin/env python3
"""Does one tenant's large store push another tenant's just-stored prefix out of memory?

Tenant ``small`` stores a ``--small-tokens`` prefix (default 2,048: 144 MB of DeepSeek-V3 MLA
latents); tenant ``large`` then stores ``--large-stores`` prefixes of ``--large-tokens``
(default three of 8,192: 576 MB each); then ``small`` loads its prefix (timed, into ``out=``
buffers, every byte checked). The same memory budget (``--budget``, default 1.5 GiB) is
spent two ways, in alternating order, each round in fresh caches:

* **a ring per tenant** (the default policy: ``recent_writes_tenant_bytes`` = half the budget
  here, so both tenants keep a ring);
* **one ring for all** (``recent_writes_tenant_bytes`` = the whole budget: whoever stores last
  takes it, as the single ring of recent writes did before).

Reported per policy: ``small``'s load ms (min / median / max), whether its load was served
from memory (the ring's ``served`` count), and the bytes the load fetched from the device
(``/proc/self/io`` read_bytes). Also, as the control of the isolation reason for
``O_DIRECT``: ``small``'s prefix, once read into the page cache, is still there after
``large``'s stores (its warm load fetches nothing from the device).

Run:  .venv/bin/python bench/ring_isolation.py [--reps 3] [--dir /tmp] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, min_med_max, print_kv
from _fixtures import deepseek_layout, prefix_tokens, random_layers, same_bits
from _plots import pyplot, save_figure

LAYERS = 61
POLICIES = ("a ring per tenant", "one ring for all")


def read_bytes() -> int:
    with open("/proc/self/io", encoding="ascii") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def load_into(ns: Any, tokens: list[int], out: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    with ns.load(tokens, out=out) as stream:
        for _ in stream:
            pass
    return time.perf_counter() - t0


def one_round(
    tenantkv: Any, root: Path, policy: str, args: argparse.Namespace, data: dict[str, Any]
) -> dict[str, float]:
    budget = int(args.budget * 2**30)
    per_tenant = budget // 2 if policy == POLICIES[0] else budget
    layout = deepseek_layout(LAYERS)
    with tenantkv.open(
        root, recent_writes_bytes=budget, recent_writes_tenant_bytes=per_tenant
    ) as kv:
        rings = kv.context.blocks.recent
        if rings is None:
            raise SystemExit("this platform has no O_DIRECT: no ring to measure")
        quota = 8 * 2**30
        for tenant in ("small", "large"):
            kv.create_tenant(tenant, quota_bytes=quota)
        small = kv.namespace("small", model="m", layout=layout)
        large = kv.namespace("large", model="m", layout=layout)
        if small.store(data["small_ids"], data["small"]) != args.small_tokens:
            raise RuntimeError("small: the store did not store the prefix")
        for i in range(args.large_stores):
            ids = prefix_tokens(1000 + i, args.large_tokens)
            if large.store(ids, data["large"]) != args.large_tokens:
                raise RuntimeError("large: the store did not store the prefix")
        out = [torch.zeros_like(w) for w in data["small"]]
        served, fetched = rings.served, read_bytes()
        seconds = load_into(small, data["small_ids"], out)
        fetched = read_bytes() - fetched
        from_ring = rings.served > served
        for got, want in zip(out, data["small"], strict=True):
            if not same_bits(got, want):
                raise AssertionError(f"{policy}: small's load differs from what it stored")
    # Control: small's prefix, read into the page cache, stays there through large's stores
    # (O_DIRECT: they go past the page cache). A cache without rings reads the files.
    with tenantkv.open(root, recent_writes_bytes=0) as plain:
        small = plain.namespace("small", model="m", layout=layout)
        large = plain.namespace("large", model="m", layout=layout)
        load_into(small, data["small_ids"], out)  # into the page cache
        for i in range(args.large_stores):
            large.store(prefix_tokens(2000 + i, args.large_tokens), data["large"])
        warm_fetched = read_bytes()
        load_into(small, data["small_ids"], out)
        warm_fetched = read_bytes() - warm_fetched
    return {
        "seconds": seconds,
        "from_ring": float(from_ring),
        "fetched": fetched,
        "warm_fetched": warm_fetched,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--small-tokens", type=int, default=2048)
    ap.add_argument("--large-tokens", type=int, default=8192)
    ap.add_argument("--large-stores", type=int, default=3)
    ap.add_argument("--budget", type=float, default=1.5, help="GiB of rings")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    import tenantkv

    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    print_kv("machine", machine_info(str(base)))
    layout = deepseek_layout(LAYERS)
    gen = torch.Generator().manual_seed(0)
    data = {
        "small_ids": prefix_tokens(1, args.small_tokens),
        "small": random_layers(layout, args.small_tokens, gen),
        "large": random_layers(layout, args.large_tokens, gen),
    }
    results: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    for r in range(args.reps):
        for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
            root = Path(tempfile.mkdtemp(prefix="ring-isolation-", dir=base))
            try:
                results[policy].append(one_round(tenantkv, root, policy, args, data))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(f"round {r + 1} {policy}: {results[policy][-1]}", flush=True)
    mb = args.small_tokens * LAYERS * 1152 / 1e6
    print(
        f"\nsmall: {args.small_tokens} tokens ({mb:.0f} MB) loaded right after large stored "
        f"{args.large_stores} x {args.large_tokens} tokens; budget {args.budget:g} GiB; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        "| policy | small's load ms min / median / max | from memory | fetched from device MB "
        "(max) | warm load after large's stores, fetched MB (max) |"
    )
    print("|---|---|---|---|---|")
    for policy, rows in results.items():
        lo, med, hi = min_med_max([row["seconds"] * 1e3 for row in rows])
        ring = sum(int(row["from_ring"]) for row in rows)
        fetched = max(row["fetched"] for row in rows) / 1e6
        warm = max(row["warm_fetched"] for row in rows) / 1e6
        print(
            f"| {policy} | {lo:.0f} / {med:.0f} / {hi:.0f} | {ring} of {len(rows)} | "
            f"{fetched:.0f} | {warm:.0f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ring_isolation.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k, (policy, rows) in enumerate(results.items()):
        ms = [row["seconds"] * 1e3 for row in rows]
        ax.scatter([k] * len(ms), ms, label=policy)
    ax.set_xticks(range(len(POLICIES)))
    ax.set_xticklabels(POLICIES)
    ax.set_ylabel("small tenant's load after large's store, ms")
    save_figure(fig, out / "ring_isolation.png")
    print(f"wrote {out / 'ring_isolation.json'} and ring_isolation.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
