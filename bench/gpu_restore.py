#!/usr/bin/env python3
"""A long DeepSeek-V3 latent prefix restored to the GPU layer by layer, against a plain
host-to-device copy of the same bytes from pinned memory (scripts/gpu_check.sh runs it).

The prefix: ``--tokens`` tokens (default 131,072: 128K) of a DeepSeek-V3 MLA latent cache (61
layers, ``kv_lora_rank`` 512 + ``rope_dim`` 64, bf16: 1,152 B per token and layer, 8.6 GiB at
128K) stored once in a tenantkv cache (extents written through the page cache,
``durable=False``, so the restores read memory: what a node serving a hot prefix sees).

Each round times, in alternating order:

* **restore**: ``Namespace.load(tokens, device=, out=)`` into preallocated device buffers
  (what a CUDA-graph engine passes): read, decrypt into pinned staging, copy to the device on
  the loader's stream, one event per layer; the consumer's stream waits on each layer's event
  (``wait_for_layer``). First layer: when layer 0 is on the device (an event recorded on the
  consumer's stream after ``wait_for_layer(0)``, synchronised); total: every layer on the
  device.
* **copy**: the same bytes, already decrypted in pinned host memory, copied layer by layer
  into the same kind of device buffers with ``non_blocking=True`` on a side stream, an event
  after layer 0: the transfer limit the restore is measured against.

Every restored byte is checked against the copy's device buffers (which are checked against the
stored layers once). Reported: min / median / max ms of the first layer and the total, GB/s, and
the ratio restore / copy of each round (same run). The target this measures (issue 35): the
whole 128K restore within 1.35x of the copy, <= 250 ms on an H200.

Without CUDA the same path runs on the CPU at ``--cpu-tokens`` (default 2,048): the restore to
``device="cpu"`` buffers and a plain copy from ordinary host memory; the GPU part is reported as
SKIPPED. That keeps the script from rotting on machines without a GPU (scripts/test.sh).

Run:
    .venv/bin/python bench/gpu_restore.py [--tokens 131072] [--reps 3] [--device auto|cuda|cpu]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LAYERS, RANK, ROPE = 61, 512, 64
GiB = 1 << 30


def make_layers(tokens: int, layers: int) -> list[torch.Tensor]:
    """Distinct bf16 rows per layer (a seeded base, rolled by the layer index): a layer landing
    in the wrong buffer, or a misplaced row, fails the check."""
    generator = torch.Generator().manual_seed(35)
    base = torch.randint(0, 1 << 16, (tokens, RANK + ROPE), generator=generator, dtype=torch.int32)
    base16 = base.to(torch.int16).view(torch.bfloat16)
    return [torch.roll(base16, shifts=index * 7, dims=0) for index in range(layers)]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit (bf16 rows of random bits hold NaNs, which ``==`` never matches)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_restore(
    ns: Any, tokens: list[int], out: list[torch.Tensor], device: torch.device
) -> tuple[float, float]:
    """(first layer, total) seconds of one layer-wise restore into ``out``."""
    sync(device)
    started = time.perf_counter()
    first = 0.0
    with ns.load(tokens, device=device, out=out) as stream:
        for index in range(len(out)):
            stream.wait_for_layer(index)  # on CUDA: the current stream waits on the layer's event
            if index == 0:
                if device.type == "cuda":
                    reached = torch.cuda.Event()
                    reached.record()
                    reached.synchronize()
                first = time.perf_counter() - started
    sync(device)
    return first, time.perf_counter() - started


def time_copy(
    source: list[torch.Tensor], out: list[torch.Tensor], device: torch.device
) -> tuple[float, float]:
    """(first layer, total) seconds of a plain layer-by-layer copy of ``source`` into ``out``
    (pinned host to device on a side stream, or host to host)."""
    sync(device)
    started = time.perf_counter()
    if device.type == "cuda":
        stream = torch.cuda.Stream(device)
        first_done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            for index, (src, dst) in enumerate(zip(source, out, strict=True)):
                dst.copy_(src, non_blocking=True)
                if index == 0:
                    first_done.record(stream)
        first_done.synchronize()
        first = time.perf_counter() - started
        stream.synchronize()
        return first, time.perf_counter() - started
    first = 0.0
    for index, (src, dst) in enumerate(zip(source, out, strict=True)):
        dst.copy_(src)
        if index == 0:
            first = time.perf_counter() - started
    return first, time.perf_counter() - started


def stats(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def main() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import format_stats_table, print_machine

    import tenantkv
    from tenantkv import KVLayout

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=131_072, help="tokens on a GPU (128K)")
    parser.add_argument("--cpu-tokens", type=int, default=2_048, help="tokens without CUDA")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        raise SystemExit("--device cuda: no CUDA device here")
    on_gpu = cuda and args.device != "cpu"
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    tokens_n = args.tokens if on_gpu else args.cpu_tokens
    tokens_n -= tokens_n % 64
    if not on_gpu:
        print(
            "GPU: SKIPPED (no CUDA device, or --device cpu): the CPU-only path at "
            f"{tokens_n} tokens follows; no figure below is a GPU figure"
        )
    else:
        print(f"GPU: {torch.cuda.get_device_name(device)}")
    layout = KVLayout.mla(args.layers, kv_lora_rank=RANK, rope_dim=ROPE, dtype=torch.bfloat16)
    total_bytes = tokens_n * layout.token_bytes * args.layers
    print(f"prefix: {tokens_n} tokens x {args.layers} layers, {total_bytes / GiB:.2f} GiB")

    with tempfile.TemporaryDirectory(prefix="tkv-gpu-restore-", dir=args.dir) as tmp:
        print_machine(tmp)
        started = time.perf_counter()
        layers = make_layers(tokens_n, args.layers)
        tokens = [(i * 7919) % 50_000 + 1 for i in range(tokens_n)]
        with tenantkv.open(Path(tmp) / "cache", durable=False) as kv:
            kv.create_tenant("bench", quota_bytes=2 * total_bytes + GiB)
            ns = kv.namespace("bench", model="deepseek-v3", layout=layout)
            stored = ns.store(tokens, layers)
            assert stored == tokens_n, f"stored {stored} of {tokens_n} tokens"
            print(f"stored in {time.perf_counter() - started:.1f} s (generation included)")

            # the copy's source: the same bytes, decrypted, in pinned memory on a GPU host
            source = [layer.pin_memory() if on_gpu else layer.clone() for layer in layers]
            for src, want in zip(source, layers, strict=True):
                assert same(src, want)
            del layers  # only the pinned copy is kept from here on
            reference = [torch.empty_like(s, device=device) for s in source]
            out = [torch.empty_like(s, device=device) for s in source]
            time_copy(source, reference, device)  # warm-up, and the reference bytes
            for ref, src in zip(reference, source, strict=True):
                assert same(ref.cpu() if on_gpu else ref, src)
            time_restore(ns, tokens, out, device)  # warm-up: staging, page cache, lookup cache

            results: dict[str, list[float]] = {
                k: [] for k in ("restore first", "restore total", "copy first", "copy total")
            }
            for rep in range(args.reps):
                order = ("restore", "copy") if rep % 2 == 0 else ("copy", "restore")
                for what in order:
                    if what == "restore":
                        for buffer in out:
                            buffer.zero_()
                        first, total = time_restore(ns, tokens, out, device)
                        for got, want in zip(out, reference, strict=True):
                            assert same(got, want), "a restored layer differs"
                    else:
                        first, total = time_copy(source, reference, device)
                    results[f"{what} first"].append(first)
                    results[f"{what} total"].append(total)

    rows = [(name, [v * 1000 for v in values], "") for name, values in results.items()]
    print()
    print(format_stats_table(rows, "ms", label=f"{'GPU' if on_gpu else 'CPU (GPU SKIPPED)'}"))
    print()
    ratios = [r / c for r, c in zip(results["restore total"], results["copy total"], strict=True)]
    restore_med = statistics.median(results["restore total"])
    copy_med = statistics.median(results["copy total"])
    restore_rate, copy_rate = total_bytes / restore_med / 1e9, total_bytes / copy_med / 1e9
    print(
        f"restore {restore_rate:.2f} GB/s, copy {copy_rate:.2f} GB/s; restore / copy per round: "
        f"min {min(ratios):.2f} median {statistics.median(ratios):.2f} max {max(ratios):.2f}"
        " (target <= 1.35 on a GPU)"
    )
    print(
        "first layer / total (restore, medians): "
        f"{statistics.median(results['restore first']) / restore_med:.3f}"
    )
    if not on_gpu:
        print("GPU: SKIPPED -- the CPU-only path ran end to end; run on a CUDA host for figures")


if __name__ == "__main__":
    main()
