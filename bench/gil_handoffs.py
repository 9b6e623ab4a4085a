"""What one GIL hand-off per segment costs: ``cryptography``'s AES-GCM ``decrypt_into`` of
72 KiB segments (64 tokens of a DeepSeek-V3 latent layer, the size a load opens), timed on one
thread alone, on two threads at once, and on one thread beside a busy Python thread.

``cryptography`` releases the GIL around each AEAD call of 2 KiB or more, so a thread that
opens segments gives the GIL away and takes it back once per segment. Alone that is cheap; with
another thread that wants the GIL (a second worker, the caller, vLLM's engine loop stepping
while a request waits) each take waits for the other thread to let go. The figures are the
reason docs/perf.md gives for the background work that slows down beside a busy engine loop
("vLLM: the hit right after its miss, and the GIL"), and the reason the loader's units of work
are whole chunks.

Rows, GB/s of segments opened (min / median / max over ``--reps`` rounds, alternating):
``1 thread`` (the baseline), ``2 threads`` (each opening the same number of segments: the
figure is both together), ``1 thread + busy Python thread`` (a thread counting in a loop beside
it, as an engine loop that steps without pause). Ratios of medians against the baseline, same
run.

    .venv/bin/python bench/gil_handoffs.py [--segments 2000] [--reps 7]
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

from _cli import bench_parser, write_outputs
from _common import format_ratios, format_stats_table
from _plots import horizontal_bars
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

SEGMENT = 64 * 576 * 2  # 64 tokens of a DeepSeek-V3 latent layer in bf16: 72 KiB


def opener(count: int) -> Callable[[], None]:
    """A task opening ``count`` sealed 72 KiB segments into a buffer of its own."""
    aead = AESGCM(AESGCM.generate_key(bit_length=256))
    nonce, aad = os.urandom(12), os.urandom(85)
    sealed = aead.encrypt(nonce, os.urandom(SEGMENT), aad)

    def run() -> None:
        out = bytearray(SEGMENT)
        for _ in range(count):
            aead.decrypt_into(nonce, sealed, aad, out)

    return run


def timed(tasks: list[Callable[[], None]], *, busy: bool = False) -> float:
    """Seconds for ``tasks`` to finish, each on a thread of its own (with a busy thread)."""
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    spinner = threading.Thread(target=spin) if busy else None
    if spinner is not None:
        spinner.start()
        time.sleep(0.01)  # the busy thread holds the GIL when the timed tasks start
    threads = [threading.Thread(target=task) for task in tasks]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    stop.set()
    if spinner is not None:
        spinner.join()
    return elapsed


def main() -> None:
    parser = bench_parser(__doc__, reps=7, data_dir=False)
    parser.add_argument("--segments", type=int, default=2000, help="segments per thread")
    args = parser.parse_args()
    count = args.segments
    busy_count = max(1, count // 10)  # beside a busy thread each call is far slower
    cases: dict[str, tuple[list[Callable[[], None]], bool, int]] = {
        "1 thread": ([opener(count)], False, count),
        "2 threads": ([opener(count), opener(count)], False, 2 * count),
        "1 thread + busy Python thread": ([opener(busy_count)], True, busy_count),
    }
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(args.reps):
        names = list(cases) if rep % 2 == 0 else list(reversed(cases))
        for name in names:
            tasks, busy, segments = cases[name]
            rates[name].append(segments * SEGMENT / timed(tasks, busy=busy) / 1e9)
    print(f"cryptography AES-GCM decrypt_into of {SEGMENT // 1024} KiB segments, GB/s")
    rows = [(name, values, "") for name, values in rates.items()]
    print(format_stats_table(rows, "GB/s", label="case"))
    base = statistics.median(rates["1 thread"])
    ratios = [(name, statistics.median(values) / base, "") for name, values in rates.items()]
    print("\nratios of medians against 1 thread (same run):")
    print(format_ratios(ratios))

    def plot(path: Path) -> None:
        horizontal_bars(path, rates, "GB/s of 72 KiB segments opened (min / median / max)")

    write_outputs(args.out, "gil_handoffs", {"gb_per_s": rates, "ratios": ratios}, plot)


if __name__ == "__main__":
    main()
