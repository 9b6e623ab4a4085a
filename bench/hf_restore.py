#!/usr/bin/env python3
"""Time to first token of a transformers model: miss vs restoring the prefix from tenantkv.

The demo's DeepSeek-V3-style model (6 layers, MLA latent 128 + rope 32, fp32, random weights)
answers an agent turn: a cached prefix of ``--prefix`` tokens (default 1,024, 2,048 and
4,096) plus 64 new tokens. For each size, in one run, round-robin (one rep of each method per
round, so machine noise hits all alike), time to first token (TTFT) of:

* miss -- full prefill of prefix + new tokens (what a tenant without the cache pays);
* in-memory cache -- the prefix's ``DynamicCache`` held in RAM (copied untimed before each
  rep), then the forward pass of the 64 new tokens: the floor any prefix cache can reach;
* tenantkv restore -- ``PrefixCache.restore`` (lookup, layer-wise load, decryption, copy into a
  ``DynamicCache``) then the forward pass of the new tokens;
* tenantkv streamed -- ``restore(streaming=True)``: layers arrive while the forward runs.

Before timing, every method's first token is checked to be the same. Reported: min / median /
max milliseconds and the ratios of medians to the miss and to the in-memory cache; a PNG plot.

Run:  .venv/bin/python bench/hf_restore.py [--prefix 1024,2048,4096] [--reps 5] [--out DIR]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _cli import bench_parser, block_sizes, write_outputs
from _common import format_stats_table, print_machine, round_robin
from _plots import median_bars, pyplot, save_figure

import tenantkv
from tenantkv.demo.model import FULL, build_model
from tenantkv.integrations.transformers import PrefixCache

NEW_TOKENS = 64
METHODS = ("miss", "in-memory cache", "tenantkv restore", "tenantkv streamed")


def _first_token(model: Any, ids: list[int], cache: Any) -> tuple[int, float]:
    """Forward the tokens ``cache`` does not hold; the first new token and the seconds taken."""
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=model.config)
    started = time.perf_counter()
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([ids[cache.get_seq_length() :]]), cache=cache, use_cache=True
        ).logits
    token = int(logits[0, -1].argmax())
    return token, time.perf_counter() - started


def _copy_cache(model: Any, source: Any, length: int) -> Any:
    from transformers import DynamicCache

    copy = DynamicCache(config=model.config)
    for index, layer in enumerate(source.layers):
        copy.update(
            layer.keys[..., :length, :].clone(), layer.values[..., :length, :].clone(), index
        )
    return copy


def measure_size(model: Any, prefix: int, reps: int, root: Path) -> dict[str, list[float]]:
    generator = torch.Generator().manual_seed(prefix)
    ids = torch.randint(0, model.config.vocab_size, (prefix + NEW_TOKENS,), generator=generator)
    tokens = ids.tolist()
    with tenantkv.open(root, durable=False) as kv:
        kv.create_tenant("acme")
        prefixes = PrefixCache(kv, "acme", model)
        from transformers import DynamicCache

        full = DynamicCache(config=model.config)
        _first_token(model, tokens[:prefix], full)
        assert prefixes.save(tokens[:prefix], full) == prefix

        def miss(_: int) -> tuple[int, float]:
            return _first_token(model, tokens, None)

        held: list[Any] = []

        def in_memory(_: int) -> tuple[int, float]:
            return _first_token(model, tokens, held.pop())

        def restore(_: int, streaming: bool = False) -> tuple[int, float]:
            started = time.perf_counter()
            restored = prefixes.restore(tokens, streaming=streaming)
            assert restored.num_tokens == prefix, "the prefix must be a hit"
            token, _ = _first_token(model, tokens, restored.cache)
            return token, time.perf_counter() - started

        runs: dict[str, Callable[[int], tuple[int, float]]] = {
            "miss": miss,
            "in-memory cache": in_memory,
            "tenantkv restore": restore,
            "tenantkv streamed": lambda rep: restore(rep, streaming=True),
        }
        held.append(_copy_cache(model, full, prefix))
        expected = {name: run(-1)[0] for name, run in runs.items()}  # untimed check + warm-up
        if len(set(expected.values())) != 1:
            raise SystemExit(f"methods disagree on the first token: {expected}")

        def timed(name: str) -> Callable[[int], float]:
            def measure(rep: int) -> float:
                token, took = runs[name](rep)
                assert token == expected[name], f"{name} changed its first token"
                return took

            return measure

        def hold(_: int) -> None:
            held.append(_copy_cache(model, full, prefix))

        seconds = round_robin(
            {name: timed(name) for name in runs}, reps, before={"in-memory cache": hold}
        )
    return seconds


def plot(results: dict[int, dict[str, list[float]]], path: Path) -> None:
    sizes = sorted(results)
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    width = 0.8 / len(METHODS)
    for index, name in enumerate(METHODS):
        samples = [[s * 1e3 for s in results[size][name]] for size in sizes]
        xs = [i + (index - (len(METHODS) - 1) / 2) * width for i in range(len(sizes))]
        median_bars(ax, xs, samples, width, edgecolor=None, label=name)
    ax.set_xticks(range(len(sizes)), [f"{s:,} cached\n+{NEW_TOKENS} new" for s in sizes])
    ax.set_ylabel("time to first token (ms, median; whiskers min/max)")
    ax.set_yscale("log")
    ax.set_title("transformers TTFT: miss vs restored prefix (DeepSeek-V3-style, CPU)")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, reps=5)
    parser.add_argument(
        "--prefix", type=block_sizes, default="1024,2048,4096", help="cached prefix sizes"
    )
    args = parser.parse_args(argv)
    sizes = args.prefix
    print_machine(args.dir)
    model = build_model(FULL)
    print(f"model: demo DeepSeek-V3-style, {FULL}, {model.dtype}; {NEW_TOKENS} new tokens\n")
    results: dict[int, dict[str, list[float]]] = {}
    for size in sizes:
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            results[size] = measure_size(model, size, args.reps, Path(root))
        rows = [(name, [s * 1e3 for s in results[size][name]], "") for name in METHODS]
        print(f"prefix {size:,} tokens + {NEW_TOKENS} new, {args.reps} rounds")
        print(format_stats_table(rows, "ms", label="TTFT", digits=1))
        medians = {name: statistics.median(results[size][name]) for name in METHODS}
        for name in METHODS[2:]:
            print(
                f"  {name}: {medians['miss'] / medians[name]:.1f}x faster than the miss; "
                f"{medians[name] / medians['in-memory cache']:.2f}x the in-memory cache"
            )
        print()
    data = {str(k): v for k, v in results.items()}
    write_outputs(args.out, "hf_restore", data, lambda png: plot(results, png), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
