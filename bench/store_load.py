#!/usr/bin/env python3
"""Store/load throughput of tenantkv against baselines measured in the same run.

What it measures (warm page cache throughout, nothing is dropped; throughput is
always *plaintext* bytes / second, 1 GB = 1e9 bytes):

* raw store / raw load -- the unencrypted baseline. The prefix's bytes, in
  tenantkv's on-disk order (layer-major: for each layer, all 64-token blocks
  back to back), are written to one file the way an atomic store would (write
  to a temp name, fsync, rename, fsync the directory) and read back with one
  ``os.preadv`` per layer into preallocated buffers, on one thread. This is
  what the disk / page cache and the kernel copy cost without any crypto.

* aes-gcm store / aes-gcm load -- the "encrypted limit" of this machine and
  Python stack. Same layout, but every (64-token block, layer) segment of
  64 * 1152 = 73,728 bytes is sealed with AES-256-GCM (+16-byte tag).
  Loading: a ``ThreadPoolExecutor`` with one thread per core, one task per
  layer; a task does one ``os.preadv`` of the layer's ciphertext into its
  thread's preallocated buffer and ``AESGCM.decrypt_into`` of each segment
  into the preallocated plaintext buffer for that layer. Storing mirrors it
  (``encrypt_into`` + ``os.pwrite`` per layer, then fsync + rename). Both are
  also run with a single thread. Nothing in tenantkv can be faster than this
  with the same cipher, so ``tenantkv load / aes-gcm load`` is the efficiency
  figure (target >= 0.7).

* tenantkv store / tenantkv load -- the public API: ``ns.store(tokens,
  layers)`` of a fresh random prefix per repetition (its extent dropped, untimed,
  after the rep, as the raw baseline unlinks its file), and the time from calling
  ``ns.load(prefix)`` until the last layer has been received (plus time to
  first layer). Skipped with ``--skip-tenantkv``.

The default size is a DeepSeek-V3-shaped prefix: 61 layers x 576 bf16 values
(MLA: kv_lora_rank 512 + rope 64 = 1,152 bytes) per token per layer, 8,192
tokens = 575.7 MB. Baseline outputs are checked once, outside the timed
region, to decrypt to exactly the original bytes; tenantkv's load is checked
the same way.

Run:  .venv/bin/python bench/store_load.py [--reps 5] [--tokens 8192]
      [--layers 61] [--threads N] [--dir /tmp] [--out bench/results]
      [--skip-tenantkv]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import shutil
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from types import ModuleType

import torch
from _common import (
    GB,
    MB,
    Result,
    format_ms_row,
    format_table,
    machine_info,
    plot_results,
    preadv_full,
    print_kv,
    publish,
    pwrite_full,
    repeat,
    stopwatch,
    write_full,
)
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

KV_LORA_RANK = 512
ROPE_DIM = 64
VALUES_PER_TOKEN = KV_LORA_RANK + ROPE_DIM  # 576
DTYPE = torch.bfloat16
BLOCK_TOKENS = 64
TAG_BYTES = 16
VOCAB_SIZE = 129_280  # DeepSeek-V3
LOAD_TARGET = 0.7  # tenantkv load / aes-gcm load limit

Span = tuple[int, int]  # (offset, length) in bytes


# --------------------------------------------------------------------------- #
# Data shape and on-disk layout
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Shape:
    layers: int
    tokens: int
    values_per_token: int = VALUES_PER_TOKEN
    bytes_per_value: int = 2
    block_tokens: int = BLOCK_TOKENS

    @property
    def token_bytes(self) -> int:
        """Bytes per token per layer (1,152 for the default)."""
        return self.values_per_token * self.bytes_per_value

    @property
    def layer_bytes(self) -> int:
        return self.tokens * self.token_bytes

    @property
    def total_bytes(self) -> int:
        return self.layers * self.layer_bytes

    @property
    def blocks(self) -> int:
        return -(-self.tokens // self.block_tokens)

    @cached_property
    def pt_spans(self) -> list[Span]:
        """Plaintext (offset, length) of each block within one layer."""
        spans = []
        for b in range(self.blocks):
            start = b * self.block_tokens
            n = min(self.block_tokens, self.tokens - start)
            spans.append((start * self.token_bytes, n * self.token_bytes))
        return spans

    @cached_property
    def ct_spans(self) -> list[Span]:
        """Ciphertext+tag (offset, length) of each block within one layer's region."""
        spans, offset = [], 0
        for _, length in self.pt_spans:
            spans.append((offset, length + TAG_BYTES))
            offset += length + TAG_BYTES
        return spans

    @property
    def layer_ct_bytes(self) -> int:
        return self.layer_bytes + self.blocks * TAG_BYTES

    @property
    def total_ct_bytes(self) -> int:
        return self.layers * self.layer_ct_bytes


def split(buf: memoryview, spans: Sequence[Span]) -> list[memoryview]:
    return [buf[off : off + length] for off, length in spans]


def make_plaintext(shape: Shape, seed: int) -> list[bytearray]:
    """One buffer per layer holding [tokens, 576] bf16 values (realistic, not zeros)."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(shape.layers):
        buf = bytearray(shape.layer_bytes)
        values = torch.randn(shape.tokens * shape.values_per_token, generator=gen, dtype=DTYPE)
        torch.frombuffer(buf, dtype=DTYPE).copy_(values)
        layers.append(buf)
    return layers


def zero(buffers: Sequence[bytearray]) -> None:
    for buf in buffers:
        torch.frombuffer(buf, dtype=torch.uint8).zero_()


def verify(name: str, got: Sequence[bytearray], want: Sequence[bytearray]) -> None:
    if len(got) != len(want):
        raise AssertionError(f"{name}: {len(got)} layers, expected {len(want)}")
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    if bad:
        raise AssertionError(f"{name}: bytes differ from the original in layers {bad[:8]}")


# --------------------------------------------------------------------------- #
# Raw (unencrypted) baseline
# --------------------------------------------------------------------------- #


def raw_store(path: Path, plain: Sequence[memoryview], dir_fd: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for layer in plain:
        write_full(fd, layer)
    publish(fd, tmp, path, dir_fd)


def raw_load(fd: int, dst: Sequence[memoryview], shape: Shape) -> None:
    for layer, buf in enumerate(dst):
        preadv_full(fd, buf, layer * shape.layer_bytes)


# --------------------------------------------------------------------------- #
# AES-256-GCM limit
# --------------------------------------------------------------------------- #


class SegmentCipher:
    """AES-256-GCM with a distinct nonce and AAD per (layer, block), precomputed."""

    def __init__(self, shape: Shape) -> None:
        self.aead = AESGCM(AESGCM.generate_key(bit_length=256))
        self.nonces = [
            [struct.pack("<4xII", layer, block) for block in range(shape.blocks)]
            for layer in range(shape.layers)
        ]
        self.aads = [
            [struct.pack("<II", layer, block) for block in range(shape.blocks)]
            for layer in range(shape.layers)
        ]


def aesgcm_releases_gil(nbytes: int = 64 << 20) -> bool:
    """Does one large ``AESGCM.decrypt_into`` call let another Python thread run?

    A spinning thread's progress during the call is compared with its progress
    during a sleep of the same length: ~0 means the GIL was held throughout.
    """
    aead, nonce = AESGCM(AESGCM.generate_key(bit_length=256)), bytes(12)
    ct = aead.encrypt(nonce, bytes(nbytes), None)
    out = bytearray(nbytes)
    count, stop = 0, threading.Event()

    def spin() -> None:
        nonlocal count
        while not stop.is_set():
            count += 1

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        time.sleep(0.02)
        c0, t0 = count, time.perf_counter()
        aead.decrypt_into(nonce, ct, None, out)
        elapsed, c1 = time.perf_counter() - t0, count
        time.sleep(elapsed)
        c2 = count
    finally:
        stop.set()
        spinner.join()
    return (c1 - c0) > 0.1 * (c2 - c1)  # held: ~0; released: ~1 (less under CPU load)


class LayerWorkers:
    """A thread pool whose workers each own a preallocated one-layer ciphertext buffer.

    All worker threads are started (and their buffers allocated) in the
    constructor, so nothing is spawned or allocated inside a timed region.
    """

    def __init__(self, threads: int, shape: Shape) -> None:
        self.threads = threads
        self._shape = shape
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="bench-layer", initializer=self._init_thread
        )
        started = threading.Barrier(threads)
        # Each task blocks until `threads` tasks run at once, forcing one thread each.
        list(self._executor.map(lambda _: started.wait(timeout=60), range(threads)))

    def _init_thread(self) -> None:
        whole = memoryview(bytearray(self._shape.layer_ct_bytes))
        self._local.whole = whole
        self._local.segments = split(whole, self._shape.ct_spans)

    def scratch(self) -> tuple[memoryview, list[memoryview]]:
        """This worker's ciphertext buffer: whole layer and per-segment views."""
        return self._local.whole, self._local.segments

    def run(self, task: Callable[[int], None], n: int) -> None:
        for _ in self._executor.map(task, range(n)):
            pass

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def aes_store(
    path: Path,
    plain_segments: Sequence[Sequence[memoryview]],
    cipher: SegmentCipher,
    workers: LayerWorkers,
    shape: Shape,
    dir_fd: int,
) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    encrypt_into = cipher.aead.encrypt_into

    def seal_layer(layer: int) -> None:
        whole, segments = workers.scratch()
        src, nonces, aads = plain_segments[layer], cipher.nonces[layer], cipher.aads[layer]
        for b, out in enumerate(segments):
            encrypt_into(nonces[b], src[b], aads[b], out)
        pwrite_full(fd, whole, layer * shape.layer_ct_bytes)

    try:
        workers.run(seal_layer, shape.layers)
    except BaseException:
        os.close(fd)
        raise
    publish(fd, tmp, path, dir_fd)


def aes_load(
    fd: int,
    dst_segments: Sequence[Sequence[memoryview]],
    cipher: SegmentCipher,
    workers: LayerWorkers,
    shape: Shape,
) -> None:
    decrypt_into = cipher.aead.decrypt_into

    def open_layer(layer: int) -> None:
        whole, segments = workers.scratch()
        preadv_full(fd, whole, layer * shape.layer_ct_bytes)
        out, nonces, aads = dst_segments[layer], cipher.nonces[layer], cipher.aads[layer]
        for b, seg in enumerate(segments):
            decrypt_into(nonces[b], seg, aads[b], out[b])

    workers.run(open_layer, shape.layers)


# --------------------------------------------------------------------------- #
# Baseline benchmarks
# --------------------------------------------------------------------------- #


def bench_baselines(
    shape: Shape, plain: list[bytearray], workdir: Path, reps: int, threads: int
) -> list[Result]:
    """Raw and AES-GCM store/load; returns [stores..., loads...]."""
    plain_views = [memoryview(b) for b in plain]
    plain_segments = [split(v, shape.pt_spans) for v in plain_views]
    dst = [bytearray(shape.layer_bytes) for _ in range(shape.layers)]
    dst_views = [memoryview(b) for b in dst]
    dst_segments = [split(v, shape.pt_spans) for v in dst_views]
    thread_counts = sorted({threads, 1}, reverse=True)
    stores: list[Result] = []
    loads: list[Result] = []

    def unlink(path_of: Callable[[int], Path]) -> Callable[[int], None]:
        def remove(rep: int) -> None:
            path_of(rep).unlink()

        return remove

    dir_fd = os.open(workdir, os.O_RDONLY)
    pools = {n: LayerWorkers(n, shape) for n in thread_counts}
    cipher = SegmentCipher(shape)
    try:
        # ---- raw -------------------------------------------------------------
        def raw_path(rep: int) -> Path:
            return workdir / f"raw-store-{rep}.bin"

        def raw_store_rep(rep: int) -> None:
            raw_store(raw_path(rep), plain_views, dir_fd)

        raw_file = workdir / "raw.bin"
        raw_store(raw_file, plain_views, dir_fd)  # warm-up, untimed; the file the loads read
        secs = repeat(stopwatch(raw_store_rep), reps, after=unlink(raw_path))
        stores.append(Result("raw store: write+fsync", "raw", 1, shape.total_bytes, secs))

        fd = os.open(raw_file, os.O_RDONLY)
        try:
            zero(dst)
            raw_load(fd, dst_views, shape)  # warm-up + correctness, untimed
            verify("raw load", dst, plain)
            secs = repeat(stopwatch(lambda _: raw_load(fd, dst_views, shape)), reps)
        finally:
            os.close(fd)
        loads.append(Result("raw load: preadv", "raw", 1, shape.total_bytes, secs))

        # ---- AES-256-GCM -----------------------------------------------------
        for n in thread_counts:
            pool = pools[n]

            def aes_path(rep: int, n: int = n) -> Path:
                return workdir / f"aes-store-{n}-{rep}.bin"

            def aes_store_rep(rep: int, pool: LayerWorkers = pool) -> None:
                aes_store(aes_path(rep), plain_segments, cipher, pool, shape, dir_fd)

            aes_store_rep(-1)  # warm-up, untimed
            aes_path(-1).unlink()
            secs = repeat(stopwatch(aes_store_rep), reps, after=unlink(aes_path))
            name = "aes-gcm store: encrypt_into+pwrite+fsync"
            stores.append(Result(name, "aes-gcm", n, shape.total_bytes, secs))

        aes_file = workdir / "aes.bin"
        aes_store(aes_file, plain_segments, cipher, pools[thread_counts[0]], shape, dir_fd)
        size = aes_file.stat().st_size
        if size != shape.total_ct_bytes:
            raise AssertionError(f"{aes_file}: size {size} != {shape.total_ct_bytes}")
        fd = os.open(aes_file, os.O_RDONLY)
        try:
            for n in thread_counts:

                def aes_load_rep(_: int, pool: LayerWorkers = pools[n]) -> None:
                    aes_load(fd, dst_segments, cipher, pool, shape)

                zero(dst)
                aes_load_rep(-1)  # warm-up + correctness, untimed
                verify(f"aes-gcm load ({n} threads)", dst, plain)
                secs = repeat(stopwatch(aes_load_rep), reps)
                name = "aes-gcm load: preadv+decrypt_into"
                loads.append(Result(name, "aes-gcm", n, shape.total_bytes, secs))
        finally:
            os.close(fd)
    finally:
        for pool in pools.values():
            pool.close()
        os.close(dir_fd)
    return stores + loads


# --------------------------------------------------------------------------- #
# tenantkv
# --------------------------------------------------------------------------- #


def import_tenantkv() -> ModuleType:
    """Import tenantkv (installed, else from the repository root) or exit with a clear message."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))
    hint = "Pass --skip-tenantkv to measure only the baselines."
    try:
        tenantkv = importlib.import_module("tenantkv")
    except Exception as exc:
        reason = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        sys.exit(
            f"error: cannot import tenantkv ({reason}).\n"
            f"Install it or run from the repository ({REPO_ROOT}). {hint}"
        )
    missing = [name for name in ("open", "KVLayout") if not hasattr(tenantkv, name)]
    if missing:
        where = getattr(tenantkv, "__file__", None) or list(getattr(tenantkv, "__path__", []))
        sys.exit(
            f"error: tenantkv (from {where}) has no {', '.join(missing)}; is it finished? {hint}"
        )
    return tenantkv


@dataclass
class TenantkvResults:
    store: Result
    load: Result
    first_layer_seconds: list[float]


def bench_tenantkv(
    tenantkv: ModuleType, root: Path, shape: Shape, plain: list[bytearray], reps: int, seed: int
) -> TenantkvResults:
    rng = random.Random(seed)
    layers = [
        torch.frombuffer(buf, dtype=DTYPE).view(shape.tokens, shape.values_per_token)
        for buf in plain
    ]

    def fresh_prefix() -> list[int]:
        return [rng.randrange(VOCAB_SIZE) for _ in range(shape.tokens)]

    with tenantkv.open(root) as kv:
        kv.create_tenant("bench", quota_bytes=64 * 2**30)  # room for every rep's prefix
        layout = tenantkv.KVLayout.mla(
            num_layers=shape.layers, kv_lora_rank=KV_LORA_RANK, rope_dim=ROPE_DIM, dtype=DTYPE
        )
        ns = kv.namespace("bench", model="deepseek-v3", layout=layout)

        # ---- store: a fresh random prefix per repetition ---------------------
        prefix = fresh_prefix()  # also the prefix the loads read back
        stored = [ns.store(prefix, layers)]  # untimed warm-up
        pending: list[list[int]] = []

        def store_once(_: int) -> float:
            tokens = pending.pop()
            t0 = time.perf_counter()
            n_new = ns.store(tokens, layers)
            elapsed = time.perf_counter() - t0
            stored.append(n_new)
            return elapsed

        kept = set(kv.context.blocks.list())  # the warm-up prefix, which the loads read

        def drop_stored(_: int) -> None:
            # Untimed, like the raw baseline's unlink after each rep: every rep writes into a
            # page cache in the same state instead of on top of the previous reps' files.
            for extent_id in set(kv.context.blocks.list()) - kept:
                kv.context.remover.drop_now(extent_id)

        store_secs = repeat(
            store_once, reps, before=lambda _: pending.append(fresh_prefix()), after=drop_stored
        )
        if len(set(stored)) != 1 or stored[0] <= 0:
            raise RuntimeError(
                f"ns.store returned inconsistent new-token counts {stored} for fresh prefixes"
            )
        if stored[0] != shape.tokens:
            print(f"warning: ns.store stored {stored[0]} of {shape.tokens} tokens per fresh prefix")
        store = Result(
            "tenantkv store",
            "tenantkv",
            None,
            stored[0] * shape.layers * shape.token_bytes,
            store_secs,
        )

        # ---- load ------------------------------------------------------------
        n = ns.lookup(prefix)
        if n <= 0:
            raise RuntimeError("ns.lookup found nothing for the prefix just stored")
        if n != shape.tokens:
            print(f"warning: ns.lookup found {n} of {shape.tokens} stored tokens")
        hit = prefix[:n]

        # Warm-up + correctness, untimed.
        seen = set()
        with ns.load(hit, device="cpu") as stream:
            for index, layer in stream:
                want = layers[index][:n]
                if tuple(layer.shape) != tuple(want.shape) or layer.dtype != DTYPE:
                    raise AssertionError(
                        f"tenantkv load layer {index}: {layer.shape} {layer.dtype}"
                    )
                if not torch.equal(layer.view(torch.int16), want.view(torch.int16)):
                    raise AssertionError(
                        f"tenantkv load layer {index}: bytes differ from what was stored"
                    )
                seen.add(index)
        if seen != set(range(shape.layers)):
            raise AssertionError(f"tenantkv load yielded layers {sorted(seen)}")

        first_layer: list[float] = []

        def load_once(_: int) -> float:
            received = 0
            first = last = 0.0
            t0 = time.perf_counter()
            with ns.load(hit, device="cpu") as stream:
                for _index, _layer in stream:
                    last = time.perf_counter()
                    if received == 0:
                        first = last
                    received += 1
            if received != shape.layers:
                raise AssertionError(
                    f"tenantkv load yielded {received} layers, expected {shape.layers}"
                )
            first_layer.append(first - t0)
            return last - t0

        load_secs = repeat(load_once, reps)
        load = Result(
            "tenantkv load", "tenantkv", None, n * shape.layers * shape.token_bytes, load_secs
        )
    return TenantkvResults(store, load, first_layer)


# --------------------------------------------------------------------------- #
# Reporting
# --------------------------------------------------------------------------- #


def find(results: Sequence[Result], prefix: str, threads: int) -> Result:
    return next(r for r in results if r.name.startswith(prefix) and r.threads == threads)


def ratios(
    results: Sequence[Result], tkv: TenantkvResults | None, threads: int
) -> list[tuple[str, float, str]]:
    raw_w, raw_r = find(results, "raw store", 1), find(results, "raw load", 1)
    aes_w, aes_r = find(results, "aes-gcm store", threads), find(results, "aes-gcm load", threads)
    aes_r1 = find(results, "aes-gcm load", 1)
    out: list[tuple[str, float, str]] = []
    if tkv is not None:
        ratio = tkv.load.median_gbps / aes_r.median_gbps
        verdict = "meets" if ratio >= LOAD_TARGET else "BELOW"
        out += [
            (
                f"tenantkv load / aes-gcm load limit ({threads} thr)",
                ratio,
                f"{verdict} target >= {LOAD_TARGET}",
            ),
            ("tenantkv load / aes-gcm load (1 thr)", tkv.load.median_gbps / aes_r1.median_gbps, ""),
            ("tenantkv load / raw load", tkv.load.median_gbps / raw_r.median_gbps, ""),
            ("tenantkv store / raw store", tkv.store.median_gbps / raw_w.median_gbps, ""),
            (
                f"tenantkv store / aes-gcm store limit ({threads} thr)",
                tkv.store.median_gbps / aes_w.median_gbps,
                "",
            ),
        ]
    out += [
        (
            f"aes-gcm load ({threads} thr) / raw load",
            aes_r.median_gbps / raw_r.median_gbps,
            "cost of crypto",
        ),
        (f"aes-gcm store ({threads} thr) / raw store", aes_w.median_gbps / raw_w.median_gbps, ""),
    ]
    if threads > 1:
        scaling = aes_r.median_gbps / aes_r1.median_gbps
        note = "thread scaling"
        if scaling < 1.25:
            note += " (little: other CPU load? see load average / 'aes-gcm GIL')"
        out.append((f"aes-gcm load {threads} thr / 1 thr", scaling, note))
    return out


def print_report(
    results: Sequence[Result], tkv: TenantkvResults | None, threads: int, reps: int
) -> list[tuple[str, float, str]]:
    print(f"Results ({reps} repetitions each; GB/s of plaintext, 1 GB = 1e9 B)")
    print(format_table(results))
    if tkv is not None:
        name_w = max(len("metric"), len("tenantkv load: time to first layer"))
        print()
        print(f"{'metric':<{name_w}}  {'min ms':>8}  {'median ms':>10}  {'max ms':>8}")
        print("-" * (name_w + 32))
        print(format_ms_row("tenantkv load: time to first layer", tkv.first_layer_seconds, name_w))
    rows = ratios(results, tkv, threads)
    name_w = max(len(name) for name, _, _ in rows)
    print()
    print("Ratios of medians (same run)")
    for name, value, note in rows:
        print(f"  {name:<{name_w}}  {value:>6.3f}  {note}")
    return rows


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tokens", type=int, default=8192, help="prefix length in tokens (default 8192)"
    )
    p.add_argument("--layers", type=int, default=61, help="number of layers (default 61)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per method (default 5)")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="threads for the aes-gcm limit (default: cores)",
    )
    p.add_argument(
        "--dir", default=None, help="parent of the temporary data dir (default: system temp, /tmp)"
    )
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results", help="where the PNG/JSON go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-tenantkv", action="store_true", help="measure only the baselines")
    args = p.parse_args(argv)
    for name in ("tokens", "layers", "reps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def describe_data(shape: Shape, reps: int, threads: int, releases_gil: bool) -> dict[str, str]:
    values = f"{shape.values_per_token} bf16 ({shape.token_bytes} B per token per layer)"
    segment = f"{shape.pt_spans[0][1]:,} B plaintext + {TAG_BYTES} B tag"
    return {
        "prefix": f"{shape.layers} layers x {shape.tokens} tokens x {values}",
        "blocks": f"{shape.blocks} blocks of {shape.block_tokens} tokens; segment = {segment}",
        "plaintext": f"{shape.total_bytes:,} B = {shape.total_bytes / MB:.1f} MB",
        "ciphertext": f"{shape.total_ct_bytes:,} B (aes-gcm file)",
        "repetitions": f"{reps} timed per method after one untimed warm-up; warm page cache",
        "aes threads": f"{threads} (and 1)",
        "aes-gcm GIL": "released during decrypt_into (threads can scale)"
        if releases_gil
        else "HELD during decrypt_into: threads cannot scale on this cryptography build",
    }


def write_outputs(
    out: Path,
    machine: dict[str, str],
    shape: Shape,
    reps: int,
    results: Sequence[Result],
    tkv: TenantkvResults | None,
    rows: Sequence[tuple[str, float, str]],
    releases_gil: bool,
) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    png, js = out / "store_load.png", out / "store_load.json"
    crypto_version = machine["cryptography"].split()[0]
    title = (
        f"tenantkv store/load vs baselines: {shape.layers} layers x {shape.tokens} tokens "
        f"x 576 bf16 ({shape.total_bytes / MB:.0f} MB), {reps} reps\n"
        f"{machine['cpu']}, {machine['cores']} cores, python {machine['python']}, "
        f"cryptography {crypto_version}"
    )
    plot_results(results, png, title)
    report = {
        "machine": machine,
        "shape": asdict(shape) | {"total_bytes": shape.total_bytes},
        "reps": reps,
        "aesgcm_releases_gil": releases_gil,
        "results": [r.as_dict() for r in results],
        "tenantkv_first_layer_seconds": tkv.first_layer_seconds if tkv else None,
        "ratios": {name: value for name, value, _ in rows},
    }
    js.write_text(json.dumps(report, indent=2) + "\n")
    return png, js


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tenantkv = None if args.skip_tenantkv else import_tenantkv()
    shape = Shape(layers=args.layers, tokens=args.tokens)
    workdir = Path(tempfile.mkdtemp(prefix="tenantkv-bench-", dir=args.dir))
    try:
        machine = machine_info(str(workdir))
        print_kv("Machine", machine)
        releases_gil = aesgcm_releases_gil()
        print_kv("Data", describe_data(shape, args.reps, args.threads, releases_gil))

        copies = 3 + (0 if tenantkv is None else args.reps + 1)
        need, free = copies * shape.total_ct_bytes, shutil.disk_usage(workdir).free
        if need > free:
            sys.exit(f"error: need ~{need / GB:.1f} GB free in {workdir}, have {free / GB:.1f} GB")

        plain = make_plaintext(shape, args.seed)
        print("measuring baselines ...", flush=True)
        (workdir / "baselines").mkdir()
        results = bench_baselines(shape, plain, workdir / "baselines", args.reps, args.threads)
        tkv: TenantkvResults | None = None
        if tenantkv is not None:
            print("measuring tenantkv ...", flush=True)
            tkv = bench_tenantkv(tenantkv, workdir / "tenantkv", shape, plain, args.reps, args.seed)
            n_stores = sum(1 for r in results if "store" in r.name)
            results = [*results[:n_stores], tkv.store, *results[n_stores:], tkv.load]
        print()
        rows = print_report(results, tkv, args.threads, args.reps)
        png, js = write_outputs(
            args.out, machine, shape, args.reps, results, tkv, rows, releases_gil
        )
        print(f"\nplot: {png}\njson: {js}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
