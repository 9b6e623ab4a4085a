#!/usr/bin/env python3
"""A load read as an engine's layer hooks read it (``wait_for_layer(i)`` for each layer, the
caller away between layers while its model computes), A/B in one process: the read-ahead window
following the layer the caller waits for (now) against the window counted from the layers the
caller consumed (before; hooks never consume, so the loader stopped ``window`` layers in and
read each later layer only once the caller was blocked on it).

The prefix: DeepSeek-V3's MLA layout (576 bf16 values per token and layer), ``--layers`` 61,
``--tokens`` 4,096, stored once, loaded into fresh layers (a load into the caller's buffers,
``out=``, has no window: its workers never wait for the caller). Between layers the caller sleeps
``--away-ms`` (0.5 ms: the host side of a GPU forward, which launches a layer's kernels and
returns, or a CPU forward's layer on other cores), so the loader's threads have the CPUs to
themselves meanwhile. The window is the cache's default (``max(2, cores)`` layers), or
``--window``.

Rows: the whole load (open to the last layer handed over) and the caller's layer waits summed
over the load, ms, min / median / max over ``--reps`` loads of each case, alternating which goes
first; the ratios of medians, same run. Every loaded byte is compared with the stored prefix
after the timed loads.

    .venv/bin/python bench/layer_hooks.py [--tokens 4096] [--layers 61] [--away-ms 0.5]
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from _cli import bench_parser, write_outputs
from _common import format_ratios, format_stats_table, print_machine
from _fixtures import (
    deepseek_layout,
    import_tenantkv,
    next_layer_counted_from_consumption,
    prefix_tokens,
    random_layers,
    same_bits,
    tenant_namespace,
)
from _plots import horizontal_bars

tenantkv = import_tenantkv()
from tenantkv.datapath.schedule import Schedule  # noqa: E402

FOLLOWS, CONSUMED = "window follows the caller", "window from consumed layers"


@contextlib.contextmanager
def window_rule(case: str) -> Iterator[None]:
    """The schedule's read-ahead rule of ``case`` while the block runs."""
    current = Schedule.next_layer
    if case == CONSUMED:
        Schedule.next_layer = next_layer_counted_from_consumption  # type: ignore[method-assign]
    try:
        yield
    finally:
        Schedule.next_layer = current  # type: ignore[method-assign]


def main() -> None:
    parser = bench_parser(__doc__, reps=30, layers=61)
    parser.add_argument("--tokens", type=int, default=4096, help="prefix tokens (4096)")
    parser.add_argument("--away-ms", type=float, default=0.5, help="caller away per layer (0.5)")
    parser.add_argument("--window", type=int, default=None, help="layers (cache default)")
    args = parser.parse_args()
    print_machine(args.dir, away_ms=str(args.away_ms))
    layout = deepseek_layout(args.layers)
    tokens = prefix_tokens(0, args.tokens)
    source = random_layers(layout, args.tokens, 0)
    total = sum(layer.numel() * layer.element_size() for layer in source)
    options = {} if args.window is None else {"window": args.window}
    kv = tenantkv.open(
        Path(tempfile.mkdtemp(prefix="layer-hooks-", dir=args.dir)) / "cache", **options
    )
    away = args.away_ms / 1000
    try:
        ns = tenant_namespace(kv, "hooks", layout, quota_bytes=2 * total + (1 << 30))
        if ns.store(tokens, source) != args.tokens:
            raise RuntimeError("the prefix was not stored whole")
        loaded: list[torch.Tensor] = []

        def load() -> tuple[float, float]:
            loaded.clear()
            waits = 0.0
            started = time.perf_counter()
            with ns.load(tokens) as stream:
                for index in range(args.layers):
                    asked = time.perf_counter()
                    loaded.append(stream.wait_for_layer(index))
                    waits += time.perf_counter() - asked
                    time.sleep(away)
            return (time.perf_counter() - started) * 1000, waits * 1000

        cases = (FOLLOWS, CONSUMED)
        whole: dict[str, list[float]] = {case: [] for case in cases}
        waits: dict[str, list[float]] = {case: [] for case in cases}
        for case in cases:
            with window_rule(case):
                load()  # warm-up
        for rep in range(args.reps):
            for case in cases if rep % 2 == 0 else reversed(cases):
                with window_rule(case):
                    took, waited = load()
                whole[case].append(took)
                waits[case].append(waited)
        for case in cases:
            with window_rule(case):
                load()
            if not all(same_bits(a, b) for a, b in zip(loaded, source, strict=True)):
                raise AssertionError(f"{case}: a loaded layer differs from the stored one")
    finally:
        kv.close()

    title = (
        f"{args.tokens:,}-token MLA loads into fresh layers ({total / 1e6:.0f} MB, {args.layers}"
        f" layers) read by layer hooks, the caller away {args.away_ms} ms per layer"
    )
    print(title)
    rows = [(f"{case}: whole load", whole[case], "") for case in cases]
    rows += [(f"{case}: layer waits", waits[case], "") for case in cases]
    print(format_stats_table(rows, "ms", label="case"))
    ratios = [
        (
            f"{FOLLOWS} / {CONSUMED}: {what}",
            statistics.median(values[FOLLOWS]) / statistics.median(values[CONSUMED]),
            "",
        )
        for what, values in (("whole load", whole), ("layer waits", waits))
    ]
    print("\nratios of medians (same run):")
    print(format_ratios(ratios))

    def plot(path: Path) -> None:
        horizontal_bars(path, {name: values for name, values, _ in rows}, "ms", title)

    write_outputs(
        args.out, "layer_hooks", {"whole_ms": whole, "waits_ms": waits, "ratios": ratios}, plot
    )


if __name__ == "__main__":
    main()
