#!/usr/bin/env python3
"""Store/load throughput of tenantkv against baselines measured in the same run.

What it measures (throughput is always *plaintext* bytes / second, 1 GB = 1e9
bytes):

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
  into the preallocated plaintext buffer for that layer (also run with a
  single thread). Storing mirrors it (``encrypt_into`` + ``os.pwrite`` per
  layer, then fsync + rename), through the page cache and, as a second limit,
  with ``O_DIRECT`` from page-aligned buffers; the store limit is the faster
  of the two. Nothing in tenantkv can be faster than this with the same
  cipher, so ``tenantkv load / aes-gcm load`` (target >= 0.7) and ``tenantkv
  store / encrypted store limit`` (target >= 0.8) are the efficiency figures.

* tenantkv store / tenantkv load -- the public API: ``ns.store(tokens,
  layers)`` of a fresh random prefix per round (its extent dropped, untimed,
  after the round, as the baselines unlink their files), and the time from
  calling ``ns.load(prefix)`` until the last layer has been received (plus
  time to first layer). Skipped with ``--skip-tenantkv``.

* a long prefix stored in steps -- ``--long-tokens`` (default 131,072) stored
  as a conversation grows, ``--long-step`` tokens (default 16,384) at a time
  with ``start=``; its GB/s against the smallest store size's (target >= 0.8).

Stores (``--store-tokens``, default 8,192 and 32,768) run in rounds in which
every method stores once, in rotating order (a noisy neighbour hits all of
them alike). Loads run on a warm page cache, nothing dropped.

The default size is a DeepSeek-V3-shaped prefix: 61 layers x 576 bf16 values
(MLA: kv_lora_rank 512 + rope 64 = 1,152 bytes) per token per layer, 8,192
tokens = 575.7 MB. Baseline outputs are checked once, outside the timed
region, to decrypt to exactly the original bytes; tenantkv's load is checked
the same way.

Run:  .venv/bin/python bench/store_load.py [--reps 5] [--tokens 8192]
      [--store-tokens 8192,32768] [--long-tokens 131072] [--long-step 16384]
      [--long-reps 3] [--layers 61] [--threads N] [--dir /tmp]
      [--out bench/results] [--skip-tenantkv] [--skip-store] [--skip-load]
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import random
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from types import ModuleType

import torch
from _cli import bench_parser, block_sizes, write_outputs
from _common import (
    GB,
    MB,
    Result,
    format_ratios,
    format_stats_table,
    format_table,
    preadv_full,
    print_kv,
    print_machine,
    publish,
    pwrite_full,
    repeat,
    stopwatch,
    tokens_label,
    write_full,
)
from _fixtures import (
    BLOCK_TOKENS,
    DTYPE,
    VALUES_PER_TOKEN,
    check_load,
    deepseek_layout,
    import_tenantkv,
    random_tokens,
    tenant_namespace,
    timed_load,
)
from _plots import plot_results
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

TAG_BYTES = 16
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

    def seal_layer(self, layer: int, src: Sequence[memoryview], out: Sequence[memoryview]) -> None:
        """Seal each plaintext segment of ``layer`` into its ciphertext+tag segment."""
        encrypt_into, nonces, aads = self.aead.encrypt_into, self.nonces[layer], self.aads[layer]
        for b, segment in enumerate(out):
            encrypt_into(nonces[b], src[b], aads[b], segment)

    def open_layer(self, layer: int, src: Sequence[memoryview], out: Sequence[memoryview]) -> None:
        """Open each sealed segment of ``layer`` into its plaintext segment."""
        decrypt_into, nonces, aads = self.aead.decrypt_into, self.nonces[layer], self.aads[layer]
        for b, segment in enumerate(src):
            decrypt_into(nonces[b], segment, aads[b], out[b])


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

    def run(self, task: Callable[[int], None], n: int) -> float:
        """Run ``task(i)`` for every i below ``n``; return when task 0 was done (perf_counter)."""
        first = [0.0]

        def timed(i: int) -> None:
            task(i)
            if i == 0:
                first[0] = time.perf_counter()

        for _ in self._executor.map(timed, range(n)):
            pass
        return first[0]

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def aes_store(
    path: Path,
    plain_segments: Sequence[Sequence[memoryview]],
    cipher: SegmentCipher,
    workers: LayerWorkers,
    shape: Shape,
    dir_fd: int,
    *,
    flags: int = 0,
    stride: int | None = None,
) -> None:
    """Seal each layer on ``workers`` and write it at ``layer * stride`` (default: layers back
    to back), then fsync + rename + directory fsync. ``flags`` are extra open flags."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    layer_stride = shape.layer_ct_bytes if stride is None else stride

    def seal_layer(layer: int) -> None:
        whole, segments = workers.scratch()
        cipher.seal_layer(layer, plain_segments[layer], segments)
        pwrite_full(fd, whole, layer * layer_stride)

    try:
        workers.run(seal_layer, shape.layers)
    except BaseException:
        os.close(fd)
        raise
    publish(fd, tmp, path, dir_fd)


DIRECT_ALIGN = 4096  # O_DIRECT: page-aligned offsets, lengths and memory


def direct_layer_bytes(shape: Shape) -> int:
    """One layer's ciphertext rounded up to whole pages: the direct limit's file puts every
    layer at a page-aligned offset, so each layer is one O_DIRECT write from its buffer."""
    return -(-shape.layer_ct_bytes // DIRECT_ALIGN) * DIRECT_ALIGN


class DirectLayerWorkers(LayerWorkers):
    """:class:`LayerWorkers` whose per-thread buffers are page-aligned (anonymous mmaps),
    one layer rounded up to whole pages, for ``O_DIRECT`` writes."""

    def _init_thread(self) -> None:
        whole = memoryview(mmap.mmap(-1, direct_layer_bytes(self._shape)))
        self._local.whole = whole
        self._local.segments = split(whole, self._shape.ct_spans)


def aes_store_direct(
    path: Path,
    plain_segments: Sequence[Sequence[memoryview]],
    cipher: SegmentCipher,
    workers: DirectLayerWorkers,
    shape: Shape,
    dir_fd: int,
) -> None:
    """The aes-gcm store limit past the page cache: like :func:`aes_store`, but each layer is
    written with ``O_DIRECT`` from its page-aligned buffer at a page-aligned offset (the pad
    after each layer is at most 4 KiB), then fsync + rename + directory fsync."""
    aes_store(
        path,
        plain_segments,
        cipher,
        workers,
        shape,
        dir_fd,
        flags=os.O_DIRECT,
        stride=direct_layer_bytes(shape),
    )


def direct_io_supported(directory: Path) -> bool:
    """Whether files under ``directory`` can be opened ``O_DIRECT`` (tmpfs cannot, for one)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".direct-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


def aes_load(
    fd: int,
    dst_segments: Sequence[Sequence[memoryview]],
    cipher: SegmentCipher,
    workers: LayerWorkers,
    shape: Shape,
) -> float:
    """Read and open every layer on ``workers``; return when layer 0 was done (perf_counter)."""

    def open_layer(layer: int) -> None:
        whole, segments = workers.scratch()
        preadv_full(fd, whole, layer * shape.layer_ct_bytes)
        cipher.open_layer(layer, segments, dst_segments[layer])

    return workers.run(open_layer, shape.layers)


# --------------------------------------------------------------------------- #
# Baseline benchmarks
# --------------------------------------------------------------------------- #


def bench_baselines(
    shape: Shape, plain: list[bytearray], workdir: Path, reps: int, threads: int
) -> list[Result]:
    """Raw and AES-GCM loads (the stores are measured by :func:`bench_stores`)."""
    plain_views = [memoryview(b) for b in plain]
    plain_segments = [split(v, shape.pt_spans) for v in plain_views]
    dst = [bytearray(shape.layer_bytes) for _ in range(shape.layers)]
    dst_views = [memoryview(b) for b in dst]
    dst_segments = [split(v, shape.pt_spans) for v in dst_views]
    thread_counts = sorted({threads, 1}, reverse=True)
    loads: list[Result] = []

    dir_fd = os.open(workdir, os.O_RDONLY)
    pools = {n: LayerWorkers(n, shape) for n in thread_counts}
    cipher = SegmentCipher(shape)
    try:
        # ---- raw -------------------------------------------------------------
        raw_file = workdir / "raw.bin"
        raw_store(raw_file, plain_views, dir_fd)  # untimed; the file the loads read
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
    return loads


# --------------------------------------------------------------------------- #
# tenantkv
# --------------------------------------------------------------------------- #


@dataclass
class TenantkvResults:
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
    with tenantkv.open(root) as kv:
        layout = deepseek_layout(shape.layers)
        ns = tenant_namespace(kv, "bench", layout, quota_bytes=64 * 2**30)  # every rep's prefix

        # The prefix the loads read back: stored once, untimed (stores: bench_stores).
        prefix = random_tokens(rng, shape.tokens)
        if ns.store(prefix, layers) != shape.tokens:
            raise RuntimeError("ns.store did not store the whole fresh prefix")

        # ---- load ------------------------------------------------------------
        n = ns.lookup(prefix)
        if n <= 0:
            raise RuntimeError("ns.lookup found nothing for the prefix just stored")
        if n != shape.tokens:
            print(f"warning: ns.lookup found {n} of {shape.tokens} stored tokens")
        hit = prefix[:n]
        check_load(ns, hit, [layer[:n] for layer in layers], device="cpu")  # and warms up

        first_layer: list[float] = []

        def load_once(_: int) -> float:
            times = timed_load(ns, hit, device="cpu")
            if times.layers != shape.layers:
                raise AssertionError(
                    f"tenantkv load yielded {times.layers} layers, expected {shape.layers}"
                )
            first_layer.append(times.first)
            return times.last

        load_secs = repeat(load_once, reps)
        load = Result(
            "tenantkv load", "tenantkv", None, n * shape.layers * shape.token_bytes, load_secs
        )
    return TenantkvResults(load, first_layer)


# --------------------------------------------------------------------------- #
# Stores: tenantkv against the store limits, rep by rep; a long prefix in steps
# --------------------------------------------------------------------------- #


@dataclass
class StoreRun:
    """The store results of one prefix size, and the limit the target is measured against."""

    tokens: int
    results: list[Result]

    def get(self, group: str, prefix: str) -> Result | None:
        return next(
            (r for r in self.results if r.group == group and r.name.startswith(prefix)), None
        )

    @property
    def tenantkv(self) -> Result | None:
        return next((r for r in self.results if r.group == "tenantkv"), None)

    @property
    def limit(self) -> Result:
        """The encrypted store limit: the faster (by median) of the buffered and the direct
        aes-gcm store, so that neither way of writing flatters tenantkv."""
        limits = [r for r in self.results if r.group == "aes-gcm"]
        return max(limits, key=lambda r: r.median_gbps)


def bench_stores(
    tenantkv: ModuleType | None,
    shape: Shape,
    plain: Sequence[memoryview],
    workdir: Path,
    reps: int,
    threads: int,
    seed: int,
) -> StoreRun:
    """Raw, aes-gcm (buffered and O_DIRECT) and tenantkv stores of one prefix size.

    The methods take turns: each round stores once with every method, in an order rotated by
    one each round, so that a burst of other load on the shared machine (or the disk's own
    writeback) falls on all of them alike instead of on whichever ran during it. Every store
    writes a new file (or a fresh random prefix), removed untimed after the round. One untimed
    round first.
    """
    label = tokens_label(shape.tokens)
    plain_segments = [split(v, shape.pt_spans) for v in plain]
    directory = workdir / f"stores-{shape.tokens}"
    directory.mkdir()
    dir_fd = os.open(directory, os.O_RDONLY)
    pool = LayerWorkers(threads, shape)
    direct = direct_io_supported(directory)
    direct_pool = DirectLayerWorkers(threads, shape) if direct else None
    cipher = SegmentCipher(shape)
    methods: list[tuple[Result, Callable[[int], float], Callable[[int], None]]] = []

    def file_method(
        name: str, group: str, n: int, store: Callable[[Path], None]
    ) -> tuple[Result, Callable[[int], float], Callable[[int], None]]:
        index = len(methods)

        def path(rep: int) -> Path:
            return directory / f"{group}-{n}-{index}-{rep}.bin"

        return (
            Result(f"{label}: {name}", group, n, shape.total_bytes, []),
            stopwatch(lambda rep: store(path(rep))),
            lambda rep: path(rep).unlink(),
        )

    methods.append(
        file_method("raw store: write+fsync", "raw", 1, lambda p: raw_store(p, plain, dir_fd))
    )
    methods.append(
        file_method(
            "aes-gcm store: encrypt_into+pwrite+fsync",
            "aes-gcm",
            threads,
            lambda p: aes_store(p, plain_segments, cipher, pool, shape, dir_fd),
        )
    )
    if direct_pool is not None:
        dpool = direct_pool
        methods.append(
            file_method(
                "aes-gcm store: encrypt_into+O_DIRECT pwrite+fsync",
                "aes-gcm",
                threads,
                lambda p: aes_store_direct(p, plain_segments, cipher, dpool, shape, dir_fd),
            )
        )
    else:
        print(f"note: {directory} refuses O_DIRECT; the store limit is the buffered one")

    kv = None
    try:
        if tenantkv is not None:
            kv = tenantkv.open(workdir / f"tenantkv-stores-{shape.tokens}")
            layout = deepseek_layout(shape.layers)
            ns = tenant_namespace(kv, "bench", layout, quota_bytes=64 * 2**30)
            layers = [
                torch.frombuffer(v, dtype=DTYPE).view(shape.tokens, shape.values_per_token)
                for v in plain
            ]
            rng = random.Random(seed)
            context = kv.context

            def tenantkv_store(_: int) -> float:
                tokens = random_tokens(rng, shape.tokens)
                t0 = time.perf_counter()
                stored = ns.store(tokens, layers)
                elapsed = time.perf_counter() - t0
                if stored != shape.tokens:
                    raise RuntimeError(f"ns.store stored {stored} of {shape.tokens} fresh tokens")
                return elapsed

            def drop_stored(_: int) -> None:
                # Untimed, like the files' unlink: every round writes into the same state.
                for extent_id in list(context.blocks.list()):
                    context.remover.drop_now(extent_id)

            result = Result(f"{label}: tenantkv store", "tenantkv", None, shape.total_bytes, [])
            methods.append((result, tenantkv_store, drop_stored))

        for rnd in range(-1, reps):  # round -1: warm-up, untimed
            shift = max(rnd, 0) % len(methods)
            for result, measure, cleanup in methods[shift:] + methods[:shift]:
                seconds = repeat(lambda _, m=measure, r=rnd: m(r), 1)[0]
                cleanup(rnd)
                if rnd >= 0:
                    result.seconds.append(seconds)
    finally:
        if kv is not None:
            kv.close()
        pool.close()
        if direct_pool is not None:
            direct_pool.close()
        os.close(dir_fd)
    return StoreRun(shape.tokens, [result for result, _, _ in methods])


@dataclass
class LongStoreRun:
    """Stepwise stores of one long prefix: ``tokens`` in steps of ``step`` with ``start=``."""

    tokens: int
    step: int
    total: Result  # the whole prefix, every step
    steps: list[list[float]]  # per rep, the seconds of each step


def bench_long_store(
    tenantkv: ModuleType,
    shape: Shape,
    step_plain: Sequence[memoryview],
    workdir: Path,
    reps: int,
    seed: int,
) -> LongStoreRun:
    """A long conversation's stores: a fresh ``shape.tokens``-token prefix stored in steps of
    ``len(step_plain[0])`` tokens, each step passing only its new tokens' KV with ``start=``
    (the issue stores 128K tokens in eight 16K-token steps). Every step's layers are the same
    ``step_plain`` bytes (what matters is that they are new blocks, not their values). Timed:
    all steps of one prefix; the prefix is looked up (untimed) to check every block was stored,
    then dropped."""
    step_tokens = len(step_plain[0]) // shape.token_bytes
    layers = [
        torch.frombuffer(v, dtype=DTYPE).view(step_tokens, shape.values_per_token)
        for v in step_plain
    ]
    rng = random.Random(seed + 1)
    steps: list[list[float]] = []
    total = Result(
        f"{tokens_label(shape.tokens)} in {tokens_label(step_tokens)} steps: tenantkv store",
        "tenantkv",
        None,
        shape.total_bytes,
        [],
    )
    with tenantkv.open(workdir / "tenantkv-long") as kv:
        layout = deepseek_layout(shape.layers)
        ns = tenant_namespace(kv, "bench", layout, quota_bytes=64 * 2**30)
        for rep in range(-1, reps):  # rep -1: warm-up, untimed
            tokens = random_tokens(rng, shape.tokens)
            times: list[float] = []
            gc.collect()
            gc.disable()
            try:
                for start in range(0, shape.tokens, step_tokens):
                    t0 = time.perf_counter()
                    stored = ns.store(tokens[: start + step_tokens], layers, start=start)
                    times.append(time.perf_counter() - t0)
                    if stored != step_tokens:
                        raise RuntimeError(f"step at {start}: stored {stored} of {step_tokens}")
            finally:
                gc.enable()
            if ns.lookup(tokens) != shape.tokens:
                raise AssertionError("the long prefix is not cached whole after its steps")
            for extent_id in list(kv.context.blocks.list()):
                kv.context.remover.drop_now(extent_id)
            if rep >= 0:
                steps.append(times)
                total.seconds.append(sum(times))
    return LongStoreRun(shape.tokens, step_tokens, total, steps)


STORE_TARGET = 0.8  # tenantkv store / encrypted store limit; long prefix / 8K figure


def store_ratios(
    runs: Sequence[StoreRun], long_run: LongStoreRun | None
) -> list[tuple[str, float, str]]:
    out: list[tuple[str, float, str]] = []
    for run in runs:
        label = tokens_label(run.tokens)
        tkv, limit = run.tenantkv, run.limit
        raw = run.get("raw", f"{label}: raw store")
        buffered = run.get("aes-gcm", f"{label}: aes-gcm store: encrypt_into+pwrite")
        direct = run.get("aes-gcm", f"{label}: aes-gcm store: encrypt_into+O_DIRECT")
        if tkv is not None:
            ratio = tkv.median_gbps / limit.median_gbps
            verdict = "meets" if ratio >= STORE_TARGET else "BELOW"
            which = "O_DIRECT" if limit is direct else "buffered"
            out.append(
                (
                    f"{label}: tenantkv store / encrypted store limit",
                    ratio,
                    f"{verdict} target >= {STORE_TARGET} (limit: aes-gcm {which})",
                )
            )
            if raw is not None:
                out.append(
                    (f"{label}: tenantkv store / raw store", tkv.median_gbps / raw.median_gbps, "")
                )
        if buffered is not None and direct is not None:
            out.append(
                (
                    f"{label}: aes-gcm store O_DIRECT / buffered",
                    direct.median_gbps / buffered.median_gbps,
                    "page-cache cost",
                )
            )
    base = next((r.tenantkv for r in runs if r.tenantkv is not None), None)
    if long_run is not None and base is not None:
        ratio = long_run.total.median_gbps / base.median_gbps
        verdict = "meets" if ratio >= STORE_TARGET else "BELOW"
        out.append(
            (
                f"{tokens_label(long_run.tokens)} stepwise / {tokens_label(runs[0].tokens)} "
                "tenantkv store",
                ratio,
                f"{verdict} target >= {STORE_TARGET}",
            )
        )
    return out


def print_store_report(
    runs: Sequence[StoreRun], long_run: LongStoreRun | None, reps: int
) -> list[tuple[str, float, str]]:
    results = [r for run in runs for r in run.results]
    if long_run is not None:
        results.append(long_run.total)
    print(f"Stores ({reps} rounds, methods in rotating order; GB/s of plaintext)")
    print(format_table(results))
    if long_run is not None:
        label = f"step GB/s ({tokens_label(long_run.step)} tokens each)"
        step_bytes = long_run.step * long_run.total.nbytes // long_run.tokens
        print()
        print(f"{'step':>4}  {'prefix after':>12}  {label:>32}")
        for i in range(len(long_run.steps[0])):
            gbps = sorted(step_bytes / rep[i] / GB for rep in long_run.steps)
            lo, mid, hi = gbps[0], statistics.median(gbps), gbps[-1]
            tokens = tokens_label((i + 1) * long_run.step)
            print(f"{i + 1:>4}  {tokens:>12}  {lo:>10.3f} / {mid:>6.3f} / {hi:>6.3f} (min/med/max)")
    rows = store_ratios(runs, long_run)
    print()
    print("Store ratios of medians (same run)")
    print(format_ratios(rows))
    return rows


# --------------------------------------------------------------------------- #
# Reporting
# --------------------------------------------------------------------------- #


def find(results: Sequence[Result], prefix: str, threads: int) -> Result:
    return next(r for r in results if r.name.startswith(prefix) and r.threads == threads)


def ratios(
    results: Sequence[Result], tkv: TenantkvResults | None, threads: int
) -> list[tuple[str, float, str]]:
    raw_r = find(results, "raw load", 1)
    aes_r = find(results, "aes-gcm load", threads)
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
        ]
    out += [
        (
            f"aes-gcm load ({threads} thr) / raw load",
            aes_r.median_gbps / raw_r.median_gbps,
            "cost of crypto",
        ),
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
        ttfl = [s * 1e3 for s in tkv.first_layer_seconds]
        print()
        print(format_stats_table([("tenantkv load: time to first layer", ttfl, "")], "ms"))
    rows = ratios(results, tkv, threads)
    print()
    print("Ratios of medians (same run)")
    print(format_ratios(rows))
    return rows


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__, reps=5, layers=61, threads=True, seed=0)
    p.add_argument("--tokens", type=int, default=8192, help="prefix length of the loads (8192)")
    p.add_argument("--skip-tenantkv", action="store_true", help="measure only the baselines")
    p.add_argument(
        "--store-tokens",
        type=block_sizes,
        default="8192,32768",
        help="prefix sizes of the store comparison, comma-separated (default 8192,32768)",
    )
    p.add_argument(
        "--long-tokens",
        type=int,
        default=131072,
        help="the long prefix stored in steps with start= (default 131072; 0: skip)",
    )
    p.add_argument("--long-step", type=int, default=16384, help="tokens per step (default 16384)")
    p.add_argument("--long-reps", type=int, default=3, help="long-prefix repetitions (default 3)")
    p.add_argument("--skip-store", action="store_true", help="measure only the loads")
    p.add_argument("--skip-load", action="store_true", help="measure only the stores")
    args = p.parse_args(argv)
    for name in ("tokens", "layers", "reps", "threads", "long_step", "long_reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.long_tokens < 0 or args.long_tokens % args.long_step:
        p.error("--long-tokens must be a multiple of --long-step (or 0)")
    if args.long_step % BLOCK_TOKENS:
        p.error(f"--long-step must be a multiple of {BLOCK_TOKENS} tokens")
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


def write_load_outputs(
    out: Path,
    machine: dict[str, str],
    shape: Shape,
    reps: int,
    results: Sequence[Result],
    tkv: TenantkvResults | None,
    rows: Sequence[tuple[str, float, str]],
    releases_gil: bool,
) -> tuple[Path, Path]:
    heading = (
        f"tenantkv store/load vs baselines: {shape.layers} layers x {shape.tokens} tokens "
        f"x 576 bf16 ({shape.total_bytes / MB:.0f} MB), {reps} reps"
    )
    report = {
        "machine": machine,
        "shape": asdict(shape) | {"total_bytes": shape.total_bytes},
        "reps": reps,
        "aesgcm_releases_gil": releases_gil,
        "results": [r.as_dict() for r in results],
        "tenantkv_first_layer_seconds": tkv.first_layer_seconds if tkv else None,
        "ratios": {name: value for name, value, _ in rows},
    }
    return _write_plot_and_report(out, "store_load", results, heading, machine, report)


def write_store_outputs(
    out: Path,
    machine: dict[str, str],
    layers: int,
    reps: int,
    runs: Sequence[StoreRun],
    long_run: LongStoreRun | None,
    rows: Sequence[tuple[str, float, str]],
) -> tuple[Path, Path]:
    results = [r for run in runs for r in run.results]
    if long_run is not None:
        results.append(long_run.total)
    heading = (
        f"tenantkv store vs the encrypted store limit: {layers} layers x 576 bf16, "
        f"{reps} rounds (methods alternating)"
    )
    report = {
        "machine": machine,
        "layers": layers,
        "reps": reps,
        "stores": [
            {"tokens": run.tokens, "results": [r.as_dict() for r in run.results]} for run in runs
        ],
        "long": None
        if long_run is None
        else {
            "tokens": long_run.tokens,
            "step": long_run.step,
            "total": long_run.total.as_dict(),
            "step_seconds": long_run.steps,
        },
        "ratios": {name: value for name, value, _ in rows},
    }
    return _write_plot_and_report(out, "store_path", results, heading, machine, report)


def _write_plot_and_report(
    out: Path,
    stem: str,
    results: Sequence[Result],
    heading: str,
    machine: dict[str, str],
    report: dict[str, object],
) -> tuple[Path, Path]:
    """``out/stem.png`` (``results`` plotted under ``heading`` and the machine) and
    ``out/stem.json`` (``report``)."""
    crypto_version = machine["cryptography"].split()[0]
    title = (
        f"{heading}\n{machine['cpu']}, {machine['cores']} cores, python {machine['python']}, "
        f"cryptography {crypto_version}"
    )
    return write_outputs(out, stem, report, lambda png: plot_results(results, png, title))


def run_stores(
    args: argparse.Namespace, tenantkv: ModuleType | None, workdir: Path, machine: dict[str, str]
) -> None:
    """The store part: tenantkv against the store limits at each ``--store-tokens`` size, then
    the long prefix in steps; tables, ratios, PNG and JSON."""
    sizes = args.store_tokens
    long_tokens = 0 if tenantkv is None else args.long_tokens
    widest = max([*sizes, min(args.long_step, long_tokens)])
    need = 2 * Shape(args.layers, max([*sizes, long_tokens])).total_ct_bytes
    free = shutil.disk_usage(workdir).free
    if need > free:
        sys.exit(f"error: stores need ~{need / GB:.1f} GB free in {workdir}, have {free / GB:.1f}")
    # One plaintext, as wide as the widest store; smaller stores use the front of each layer.
    plain = make_plaintext(Shape(args.layers, widest), args.seed)
    runs = []
    for tokens in sizes:
        shape = Shape(args.layers, tokens)
        print(f"measuring stores of {tokens} tokens ...", flush=True)
        views = [memoryview(b)[: shape.layer_bytes] for b in plain]
        runs.append(
            bench_stores(tenantkv, shape, views, workdir, args.reps, args.threads, args.seed)
        )
    long_run = None
    if tenantkv is not None and long_tokens:
        shape = Shape(args.layers, long_tokens)
        step_bytes = args.long_step * shape.token_bytes
        print(f"measuring {long_tokens} tokens stored in {args.long_step}-token steps ...")
        views = [memoryview(b)[:step_bytes] for b in plain]
        long_run = bench_long_store(tenantkv, shape, views, workdir, args.long_reps, args.seed)
    del plain
    print()
    rows = print_store_report(runs, long_run, args.reps)
    write_store_outputs(args.out, machine, args.layers, args.reps, runs, long_run, rows)
    print()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    hint = "Pass --skip-tenantkv to measure only the baselines."
    tenantkv = None if args.skip_tenantkv else import_tenantkv(hint)
    shape = Shape(layers=args.layers, tokens=args.tokens)
    workdir = Path(tempfile.mkdtemp(prefix="tenantkv-bench-", dir=args.dir))
    try:
        machine = print_machine(workdir)
        releases_gil = aesgcm_releases_gil()
        print_kv("Data", describe_data(shape, args.reps, args.threads, releases_gil))
        if not args.skip_store:
            run_stores(args, tenantkv, workdir, machine)
        if args.skip_load:
            return 0

        copies = 3 + (0 if tenantkv is None else 1)
        need, free = copies * shape.total_ct_bytes, shutil.disk_usage(workdir).free
        if need > free:
            sys.exit(f"error: need ~{need / GB:.1f} GB free in {workdir}, have {free / GB:.1f} GB")

        plain = make_plaintext(shape, args.seed)
        print("measuring load baselines ...", flush=True)
        (workdir / "baselines").mkdir()
        results = bench_baselines(shape, plain, workdir / "baselines", args.reps, args.threads)
        tkv: TenantkvResults | None = None
        if tenantkv is not None:
            print("measuring tenantkv loads ...", flush=True)
            tkv = bench_tenantkv(tenantkv, workdir / "tenantkv", shape, plain, args.reps, args.seed)
            results = [*results, tkv.load]
        print()
        rows = print_report(results, tkv, args.threads, args.reps)
        write_load_outputs(args.out, machine, shape, args.reps, results, tkv, rows, releases_gil)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
