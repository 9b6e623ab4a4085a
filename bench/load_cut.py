"""How an ``out=`` load is cut: every layer shared by the workers within a window of the caller
(the policy before, reproduced here), or whole layers per worker with no window
(``tenantkv.datapath.load_workers.load_window`` / ``later_layer_shares``), each with 8 MiB and
16 MiB staging slots, beside the encrypted limit of the same bytes, warm, in one process.

The loads are the peer benchmark's warm tenantkv row (bench/peers, ``ns.load(tokens,
out=bufs)``): a DeepSeek-V3 latent prefix (61 layers, 576 values of bf16 a token) stored once
in a durable cache (``O_DIRECT`` writes, no ring of recent writes), loaded again and again from
the page cache. The previous policy is the current code with the two functions put back to
what they were (a window of ``max(2, cores)`` layers for every load; each later layer cut into
one equal share per worker, or more where a slot holds less). The encrypted limit
(``store_load.aes_load``: per layer one ``preadv`` and ``decrypt_into``, 2 threads) reads a
file of the same sealed segments. Rounds alternate the order; every load's bytes are checked.

Rows: GB/s, min / median / max over ``--reps`` rounds; ratios of medians against the limit and
against the previous policy in 8 MiB slots (the default before), same run.

    .venv/bin/python bench/load_cut.py [--tokens 8192] [--block-tokens 64] [--reps 10]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _cli import bench_parser, write_outputs
from _common import format_ratios, format_stats_table, print_machine
from _fixtures import byte_view, deepseek_layout, import_tenantkv, prefix_tokens, tenant_namespace
from _plots import horizontal_bars
from store_load import LayerWorkers, SegmentCipher, Shape, aes_load, aes_store, split

tenantkv = import_tenantkv()
from tenantkv.datapath import load_workers  # noqa: E402  (after import_tenantkv's hint)

CURRENT = (load_workers.load_window, load_workers.later_layer_shares)


def previous_window(target: object, num_layers: int, window: int) -> int:
    return max(1, window)


def previous_shares(window: int, num_layers: int, workers: int) -> int:
    return workers


def use_policy(current: bool) -> None:
    """The cut the next load takes (read once, when its stream starts)."""
    window, shares = CURRENT if current else (previous_window, previous_shares)
    load_workers.load_window = window  # type: ignore[assignment]
    load_workers.later_layer_shares = shares


def main() -> None:
    parser = bench_parser(__doc__, reps=10, layers=61)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block-tokens", type=int, default=64)
    args = parser.parse_args()
    print_machine(args.dir)
    shape = Shape(layers=args.layers, tokens=args.tokens, block_tokens=args.block_tokens)
    root = Path(tempfile.mkdtemp(prefix="load-cut-", dir=args.dir))
    generator = torch.Generator().manual_seed(0)
    want = [
        torch.randn(shape.tokens, 576, generator=generator).to(torch.bfloat16)
        for _ in range(shape.layers)
    ]
    tokens = prefix_tokens(0, shape.tokens)
    caches = []
    loads: dict[str, Callable[[], None]] = {}
    bufs = [torch.empty_like(layer) for layer in want]
    pool = LayerWorkers(2, shape)
    fd = -1
    try:
        for slot_mib in (8, 16):
            kv = tenantkv.open(
                root / f"slots-{slot_mib}",
                recent_writes_bytes=0,
                staging_slot_bytes=slot_mib << 20,
                staging_bytes=8 * (slot_mib << 20),
            )
            caches.append(kv)
            ns = tenant_namespace(
                kv,
                "cut",
                deepseek_layout(shape.layers),
                quota_bytes=4 * shape.total_bytes + (1 << 30),
                block_tokens=args.block_tokens,
            )
            if ns.store(tokens, want) != shape.tokens:
                raise RuntimeError("the prefix was not stored whole")
            for current in (False, True):

                def load(ns: object = ns, current: bool = current) -> None:
                    use_policy(current)
                    with ns.load(tokens, out=bufs) as stream:  # type: ignore[attr-defined]
                        for _ in stream:
                            pass

                policy = "whole layers, no window" if current else "before: shared layers"
                loads[f"{policy}, {slot_mib} MiB slots"] = load
        cipher = SegmentCipher(shape)
        plain = [split(byte_view(layer), shape.pt_spans) for layer in want]
        dir_fd = os.open(root, os.O_RDONLY)
        try:
            aes_store(root / "limit.bin", plain, cipher, pool, shape, dir_fd)
        finally:
            os.close(dir_fd)
        fd = os.open(root / "limit.bin", os.O_RDONLY)
        dst = [split(byte_view(b), shape.pt_spans) for b in bufs]
        loads = {
            "encrypted limit (2 threads)": lambda: aes_load(fd, dst, cipher, pool, shape)
        } | loads

        def check(name: str) -> None:
            for got, expected in zip(bufs, want, strict=True):
                if not torch.equal(got.view(torch.int16), expected.view(torch.int16)):
                    raise AssertionError(f"{name}: a loaded layer differs from the stored one")

        for name, load in loads.items():  # warm-up (the first tenantkv loads read the device)
            for _ in range(2):
                for buf in bufs:
                    buf.zero_()
                load()
                check(name)
        rates: dict[str, list[float]] = {name: [] for name in loads}
        names = list(loads)
        for rep in range(args.reps):
            for name in names if rep % 2 == 0 else reversed(names):
                for buf in bufs:
                    buf.zero_()
                started = time.perf_counter()
                loads[name]()
                rates[name].append(shape.total_bytes / (time.perf_counter() - started) / 1e9)
                check(name)
    finally:
        use_policy(True)
        pool.close()
        if fd >= 0:
            os.close(fd)
        for kv in caches:
            kv.close()

    title = (
        f"warm out= loads of {shape.tokens:,} tokens x {shape.layers} layers "
        f"({shape.total_bytes / 1e6:.0f} MB), {args.block_tokens}-token blocks, GB/s"
    )
    print(title)
    print(format_stats_table([(name, v, "") for name, v in rates.items()], "GB/s", label="load"))
    medians = {name: statistics.median(v) for name, v in rates.items()}
    limit = medians["encrypted limit (2 threads)"]
    before = medians["before: shared layers, 8 MiB slots"]
    ratios = [(f"{name} / limit", m / limit, "") for name, m in medians.items()]
    ratios += [(f"{name} / before, 8 MiB", m / before, "") for name, m in medians.items()]
    print("\nratios of medians (same run):")
    print(format_ratios(ratios))

    def plot(path: Path) -> None:
        horizontal_bars(path, rates, "GB/s (min / median / max)", title)

    write_outputs(
        args.out,
        f"load_cut_{shape.tokens}_{args.block_tokens}",
        {"gb_per_s": rates, "ratios": ratios, "shape": vars(args) | {"dir": str(args.dir)}},
        plot,
    )


if __name__ == "__main__":
    main()
