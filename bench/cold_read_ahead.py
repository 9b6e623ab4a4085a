"""Read-ahead advice on cold loads, A/B in one process: an 8K-token ``out=`` load with its page
cache dropped first, then three warm loads of the bytes that cold load brought in, with the
cold reader advising the kernel ahead of its reads (``POSIX_FADV_WILLNEED``, 64 MiB ahead in 16
MiB steps: every cold reader before) or not (the kernel's own read-ahead, doubled by
``POSIX_FADV_SEQUENTIAL``: what ``tenantkv.storage.local_reader.needs_read_ahead_advice``
decides where the device reads ahead at least 8 MiB).

Why the warm loads: advice fills the page cache in single pages where the kernel's read-ahead
uses large folios, and each later warm read of those pages pays for it. The device's own window
(``read_ahead_kb``) is printed; the A/B means most on a device whose window is the one the
decision is about.

Rows: GB/s, min / median / max over ``--reps`` rounds (alternating which policy goes first; the
warm figure of a round is the median of its three warm loads); ratios of medians, same run.
Every load's bytes are checked.

    .venv/bin/python bench/cold_read_ahead.py [--tokens 8192] [--reps 10]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _cli import bench_parser, write_outputs
from _common import format_ratios, format_stats_table, print_machine
from _fixtures import deepseek_layout, import_tenantkv, prefix_tokens, tenant_namespace
from _plots import horizontal_bars

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from modes import evict_files

tenantkv = import_tenantkv()
from tenantkv.storage import local_reader  # noqa: E402  (after import_tenantkv's hint)

DECIDE = local_reader.needs_read_ahead_advice
POLICIES = {
    "advice always (before)": lambda window: True,
    "advice where the kernel falls short": DECIDE,
}


def main() -> None:
    parser = bench_parser(__doc__, reps=10, layers=61)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cold-read-ahead-", dir=args.dir))
    window = local_reader.device_read_ahead_bytes(os.stat(root).st_dev)
    print_machine(
        args.dir,
        **{"device read_ahead_kb": "unknown" if window is None else str(window // 1024)},
    )
    generator = torch.Generator().manual_seed(0)
    want = [
        torch.randn(args.tokens, 576, generator=generator).to(torch.bfloat16)
        for _ in range(args.layers)
    ]
    total = sum(layer.numel() * layer.element_size() for layer in want)
    tokens = prefix_tokens(0, args.tokens)
    bufs = [torch.empty_like(layer) for layer in want]
    kv = tenantkv.open(root / "cache", recent_writes_bytes=0)
    try:
        ns = tenant_namespace(
            kv, "cold", deepseek_layout(args.layers), quota_bytes=4 * total + (1 << 30)
        )
        if ns.store(tokens, want) != args.tokens:
            raise RuntimeError("the prefix was not stored whole")
        files = [path for path in (root / "cache").rglob("*.tkx")]

        def load() -> float:
            for buf in bufs:
                buf.zero_()
            started = time.perf_counter()
            with ns.load(tokens, out=bufs) as stream:
                for _ in stream:
                    pass
            rate = total / (time.perf_counter() - started) / 1e9
            for got, expected in zip(bufs, want, strict=True):
                if not torch.equal(got.view(torch.int16), expected.view(torch.int16)):
                    raise AssertionError("a loaded layer differs from the stored one")
            return rate

        load()
        rates: dict[str, list[float]] = {}
        for rep in range(args.reps):
            names = list(POLICIES) if rep % 2 == 0 else list(reversed(POLICIES))
            for name in names:
                local_reader.needs_read_ahead_advice = POLICIES[name]
                evict_files(files)
                rates.setdefault(f"{name}: cold", []).append(load())
                warm = statistics.median(load() for _ in range(3))
                rates.setdefault(f"{name}: warm after it", []).append(warm)
    finally:
        local_reader.needs_read_ahead_advice = DECIDE
        kv.close()

    title = f"{args.tokens:,}-token out= loads ({total / 1e6:.0f} MB), GB/s"
    print(title)
    print(format_stats_table([(name, v, "") for name, v in rates.items()], "GB/s", label="load"))
    medians = {name: statistics.median(v) for name, v in rates.items()}
    before, now = POLICIES
    ratios = [
        (f"{mode}: {now} / {before}", medians[f"{now}: {mode}"] / medians[f"{before}: {mode}"], "")
        for mode in ("cold", "warm after it")
    ]
    print("\nratios of medians (same run):")
    print(format_ratios(ratios))

    def plot(path: Path) -> None:
        horizontal_bars(path, rates, "GB/s (min / median / max)", title)

    data = {"gb_per_s": rates, "ratios": ratios, "device_read_ahead_bytes": window}
    write_outputs(args.out, "cold_read_ahead", data, plot)


if __name__ == "__main__":
    main()
