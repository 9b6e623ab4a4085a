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

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import format_stats_table, machine_info, print_kv

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
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for rep in range(reps):
            for name, run in runs.items():
                if name == "in-memory cache":
                    held.append(_copy_cache(model, full, prefix))
                gc.collect()
                gc.disable()
                try:
                    token, took = run(rep)
                finally:
                    gc.enable()
                assert token == expected[name], f"{name} changed its first token"
                seconds[name].append(took)
    return seconds


def plot(results: dict[int, dict[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(results)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(METHODS)
    for index, name in enumerate(METHODS):
        medians = [statistics.median(results[s][name]) * 1e3 for s in sizes]
        lows = [m - min(results[s][name]) * 1e3 for m, s in zip(medians, sizes, strict=True)]
        highs = [max(results[s][name]) * 1e3 - m for m, s in zip(medians, sizes, strict=True)]
        xs = [i + (index - (len(METHODS) - 1) / 2) * width for i in range(len(sizes))]
        ax.bar(xs, medians, width, yerr=[lows, highs], capsize=3, label=name)
    ax.set_xticks(range(len(sizes)), [f"{s:,} cached\n+{NEW_TOKENS} new" for s in sizes])
    ax.set_ylabel("time to first token (ms, median; whiskers min/max)")
    ax.set_yscale("log")
    ax.set_title("transformers TTFT: miss vs restored prefix (DeepSeek-V3-style, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default="1024,2048,4096", help="cached prefix sizes")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.prefix.split(",")]
    if any(size <= 0 or size % 64 for size in sizes):
        parser.error("--prefix sizes must be positive multiples of 64")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print_kv("machine", machine_info(args.dir))
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
    plot(results, out / "hf_restore.png")
    (out / "hf_restore.json").write_text(
        json.dumps({str(k): v for k, v in results.items()}, indent=1), encoding="utf-8"
    )
    print(f"wrote {out / 'hf_restore.png'} and {out / 'hf_restore.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
