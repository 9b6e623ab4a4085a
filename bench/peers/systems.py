"""The systems a prefix load is compared across, each behind one small interface.

Every system loads the same DeepSeek-V3-shaped prefix (``layers`` x ``tokens`` x 576 bf16) from
files in a warm page cache into CPU memory, and says when its first layer was usable. The
unencrypted ones (raw ``preadv``, safetensors, ``torch.save``, LMCache) and the encrypted limit
are set up here from plain files; tenantkv goes through its public API only
(``tenantkv.open``, ``ns.store``, ``ns.load``), so a change of its load path keeps this working.

A system's ``load()`` returns what it loaded (untimed checks compare it with the original after
the rep) and the seconds from the call to the first usable layer. ``lazy`` marks a system whose
returned tensors are mapped pages it never read (safetensors' mmap): its load time says little
until the pages are touched, which the ``+ touch`` variant does.
"""

from __future__ import annotations

import gc
import os
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent.parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

from _common import preadv_full, pwrite_full  # noqa: E402
from _fixtures import DTYPE, byte_view, deepseek_layout, same_bits, tenant_namespace  # noqa: E402
from store_load import LayerWorkers, SegmentCipher, Shape, aes_load, split  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

Loaded = Any  # what a system's load returns; its own `layers()` turns it into views


@dataclass
class System:
    """One way of loading the prefix.

    ``run()`` does one load and returns (loaded, seconds to the first usable layer, total
    seconds). ``layers(loaded)`` gives, per layer, the tensors to compare with the original
    (one tensor, or one per chunk for LMCache). ``release(loaded)`` frees it (LMCache's pool).
    ``prepare()`` runs untimed before each rep (zeroing a reused destination, so a stale
    correct buffer cannot pass the check).
    """

    name: str
    # plot colour: raw, encrypted-limit, decrypt-ceiling, lmcache, safetensors, torch, tenantkv
    group: str
    run: Callable[[], tuple[Loaded, float, float]]
    layers: Callable[[Loaded], list[list[torch.Tensor]]]
    release: Callable[[Loaded], None] = lambda _loaded: None
    prepare: Callable[[], None] = lambda: None
    lazy: bool = False  # returns mapped pages it never read
    ttfl_is_total: bool = False  # its first layer is only usable when the whole load is done
    note: str = ""
    #: What its load must give, where not the original: a lossy codec's own decode of the codes
    #: it stored (checked bit for bit like the rest).
    want: Sequence[torch.Tensor] | None = None
    #: The bytes its files hold for the prefix, where fewer than the prefix's (a codec's codes):
    #: a cold load of it fetches these from the device.
    stored_bytes: int | None = None
    seconds: list[float] = field(default_factory=list)
    first_layer: list[float] = field(default_factory=list)
    cold_bytes: list[int] = field(default_factory=list)  # fetched from storage, per timed load


def per_layer(got: Loaded) -> list[list[torch.Tensor]]:
    """A load that returns one tensor per layer, as the check wants it."""
    return [[t] for t in got]


# --------------------------------------------------------------------------- #
# Files on disk, written once per size (untimed)
# --------------------------------------------------------------------------- #


def safetensors_path(directory: Path, layer: int) -> Path:
    return directory / f"layer{layer:03d}.safetensors"


def safetensors_data_offset(path: Path) -> int:
    """Where the single tensor's bytes start: 8-byte header length + the JSON header."""
    import json

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    begin, _end = header["kv"]["data_offsets"]
    return 8 + n + int(begin)


def write_layer_files(
    directory: Path, shape: Shape, seed: int
) -> tuple[list[torch.Tensor], list[int]]:
    """Generate the prefix layer by layer into one safetensors file per layer.

    Returns the original, as read-only views of those files' data (copy-on-write mmaps: no
    second copy in memory; each was compared with the generated layer before it was dropped),
    and each file's data offset (the raw ``preadv`` baseline reads these same bytes).
    """
    import mmap

    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    want: list[torch.Tensor] = []
    offsets: list[int] = []
    for layer in range(shape.layers):
        values = torch.randn(shape.tokens, shape.values_per_token, generator=gen).to(DTYPE)
        path = safetensors_path(directory, layer)
        save_file({"kv": values}, str(path))
        offset = safetensors_data_offset(path)
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        view = torch.frombuffer(
            mapped, dtype=DTYPE, count=shape.tokens * shape.values_per_token, offset=offset
        ).view(shape.tokens, shape.values_per_token)
        if not same_bits(view, values):
            raise AssertionError(f"{path}: the file does not hold the generated layer")
        want.append(view)
        offsets.append(offset)
    return want, offsets


def write_encrypted_file(
    path: Path, want: Sequence[torch.Tensor], shape: Shape, cipher: SegmentCipher
) -> None:
    """The encrypted limit's file: each (64-token block, layer) segment sealed, layer-major."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        scratch = memoryview(bytearray(shape.layer_ct_bytes))
        segments = split(scratch, shape.ct_spans)
        for layer, plain in enumerate(want):
            cipher.seal_layer(layer, split(byte_view(plain.contiguous()), shape.pt_spans), segments)
            pwrite_full(fd, scratch, layer * shape.layer_ct_bytes)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- #
# Unencrypted peers and the encrypted limit
# --------------------------------------------------------------------------- #


def raw_systems(
    fds: Sequence[int],
    offsets: Sequence[int],
    bufs: Sequence[torch.Tensor],
    pool: LayerWorkers,
    zero: Callable[[], None],
) -> list[System]:
    """``os.preadv`` of each layer's bytes (the safetensors files' data) into ``bufs``."""
    views = [byte_view(b) for b in bufs]

    def single() -> tuple[Loaded, float, float]:
        t0 = time.perf_counter()
        first = 0.0
        for layer, view in enumerate(views):
            preadv_full(fds[layer], view, offsets[layer])
            if layer == 0:
                first = time.perf_counter()
        return bufs, first - t0, time.perf_counter() - t0

    def threaded() -> tuple[Loaded, float, float]:
        t0 = time.perf_counter()

        def task(layer: int) -> None:
            preadv_full(fds[layer], views[layer], offsets[layer])

        first = pool.run(task, len(views))
        return bufs, first - t0, time.perf_counter() - t0

    return [
        System("raw preadv", "raw", single, per_layer, prepare=zero, note="1 thread"),
        System(
            "raw preadv",
            "raw",
            threaded,
            per_layer,
            prepare=zero,
            note=f"{pool.threads} threads",
        ),
    ]


def encrypted_limit_system(
    fd: int,
    bufs: Sequence[torch.Tensor],
    shape: Shape,
    cipher: SegmentCipher,
    pool: LayerWorkers,
    zero: Callable[[], None],
) -> System:
    """bench/streaming.py's limit (store_load's ``aes_load``): per layer one ``preadv`` of its
    ciphertext + decrypt_into."""
    dst = [split(byte_view(b), shape.pt_spans) for b in bufs]

    def run() -> tuple[Loaded, float, float]:
        t0 = time.perf_counter()
        first = aes_load(fd, dst, cipher, pool, shape)
        return bufs, first - t0, time.perf_counter() - t0

    return System(
        "encrypted limit: preadv + AES-GCM decrypt_into",
        "encrypted-limit",
        run,
        per_layer,
        prepare=zero,
        note=f"{pool.threads} threads",
    )


def decrypt_ceiling_systems(
    fd: int,
    bufs: Sequence[torch.Tensor],
    shape: Shape,
    cipher: SegmentCipher,
    pools: Sequence[LayerWorkers],
    zero: Callable[[], None],
) -> list[System]:
    """The bound on any encrypted load on this machine: the encrypted limit's decryption with
    no read at all, every layer's ciphertext held in memory (read once, untimed, and shared by
    one system per pool). Its GB/s is what the cores decrypt from memory into the destination;
    a load that also reads cannot beat it, so where it is below LMCache's (a copy out of the
    page cache) the target "encrypted load >= LMCache" is out of reach on this machine."""
    held = []
    for layer in range(shape.layers):
        whole = memoryview(bytearray(shape.layer_ct_bytes))
        preadv_full(fd, whole, layer * shape.layer_ct_bytes)
        held.append(split(whole, shape.ct_spans))
    dst = [split(byte_view(b), shape.pt_spans) for b in bufs]

    def decrypt_held(pool: LayerWorkers) -> Callable[[], tuple[Loaded, float, float]]:
        def run() -> tuple[Loaded, float, float]:
            t0 = time.perf_counter()
            first = pool.run(
                lambda layer: cipher.open_layer(layer, held[layer], dst[layer]), shape.layers
            )
            return bufs, first - t0, time.perf_counter() - t0

        return run

    return [
        System(
            "decrypt-only ceiling: AES-GCM decrypt_into from memory, no reads",
            "decrypt-ceiling",
            decrypt_held(pool),
            per_layer,
            prepare=zero,
            note="1 thread" if pool.threads == 1 else f"{pool.threads} threads",
        )
        for pool in pools
    ]


def touch_pages(t: torch.Tensor) -> int:
    """Read one byte of every page of ``t`` (faults each mapped page in); returns their sum."""
    flat = t.view(torch.uint8).view(-1).numpy()  # numpy: one thread, no pool to wake
    return int(flat[::PAGE].sum())


def safetensors_systems(
    directory: Path, shape: Shape, bufs: Sequence[torch.Tensor], zero: Callable[[], None]
) -> list[System]:
    """``safetensors.torch.load_file`` per layer: mmap (lazy), mmap + touch, mmap + copy into
    the caller's buffers (what an engine does with it: vLLM's example connector loads the file
    and copies it into its KV cache), and the copying ``pread`` backend."""
    from safetensors.torch import load_file

    paths = [str(safetensors_path(directory, layer)) for layer in range(shape.layers)]
    dst = [byte_view(b) for b in bufs]

    def make(backend: str, then: str) -> Callable[[], tuple[Loaded, float, float]]:
        def run() -> tuple[Loaded, float, float]:
            t0 = time.perf_counter()
            first = 0.0
            out: list[torch.Tensor] = []
            for layer, path in enumerate(paths):
                tensor = load_file(path, backend=backend)["kv"]
                if then == "touch":
                    touch_pages(tensor)
                elif then == "copy":  # one memcpy (torch's copy_ wakes its thread pool)
                    dst[layer][:] = byte_view(tensor)
                    tensor = bufs[layer]
                out.append(tensor)
                if layer == 0:
                    first = time.perf_counter()
            return out, first - t0, time.perf_counter() - t0

        return run

    return [
        System(
            "safetensors load_file, mmap",
            "safetensors",
            make("mmap", ""),
            per_layer,
            lazy=True,
            note="pages mapped, never read",
        ),
        System(
            "safetensors load_file, mmap + touch every page",
            "safetensors",
            make("mmap", "touch"),
            per_layer,
            note="zero-copy: one byte read per page",
        ),
        System(
            "safetensors load_file, mmap + copy into caller buffers",
            "safetensors",
            make("mmap", "copy"),
            per_layer,
            prepare=zero,
            note="memcpy into bufs[i]",
        ),
        System(
            "safetensors load_file, pread (copy)",
            "safetensors",
            make("pread", ""),
            per_layer,
            note="backend='pread'",
        ),
    ]


def torch_save_system(path: Path) -> System:
    def run() -> tuple[Loaded, float, float]:
        t0 = time.perf_counter()
        got = torch.load(path, weights_only=True)
        t1 = time.perf_counter()
        return got, t1 - t0, t1 - t0

    return System(
        "torch.save / torch.load",
        "torch",
        run,
        per_layer,
        ttfl_is_total=True,
        note="one file, list of layers",
    )


# --------------------------------------------------------------------------- #
# tenantkv, through its public API only
# --------------------------------------------------------------------------- #


def suite_names(tenantkv: Any) -> list[str]:
    """Every cipher suite the project offers (``tenantkv.crypto.CipherSuite``), by config name."""
    from tenantkv.crypto import CipherSuite

    return [member.name.lower().replace("_", "-") for member in CipherSuite]


class TenantkvPrefix:
    """One cache (one cipher suite) holding the prefix in one namespace: of the namespace's
    default block size, or ``block_tokens``, and of codec ``none``, or ``codec`` (both named in
    the systems' labels). A lossy codec's loads are checked against its own decode of the codes
    its store wrote, not against the original values."""

    def __init__(
        self,
        tenantkv: Any,
        root: Path,
        suite: str,
        shape: Shape,
        tokens: list[int],
        want: Sequence[torch.Tensor],
        block_tokens: int | None = None,
        open_kwargs: dict[str, Any] | None = None,
        quota_bytes: int | None = None,
        codec: str = "none",
    ) -> None:
        self.suite = suite if block_tokens is None else f"{suite} {block_tokens}-token blocks"
        if codec != "none":
            self.suite += f", codec {codec}"
        self.root = root
        self.kv = tenantkv.open(root, suite=suite, **(open_kwargs or {}))
        options: dict[str, Any] = {} if block_tokens is None else {"block_tokens": block_tokens}
        if codec != "none":
            options["codec"] = codec
        quota = quota_bytes or 4 * shape.total_ct_bytes + 2**30
        layout = deepseek_layout(shape.layers)
        self.ns = tenant_namespace(self.kv, "peers", layout, quota_bytes=quota, **options)
        coded, block = self.ns.layout, self.ns.block_tokens
        #: What a load gives: the original, or the codec's decode of the stored codes.
        self.want: list[torch.Tensor] | None = None
        self.stored_bytes: int | None = None
        if coded.encoded:
            self.want = [
                coded.coder.decode(coded, coded.coder.encode(coded, w, block), block) for w in want
            ]
            self.stored_bytes = shape.layers * shape.tokens // block * coded.segment_bytes(block)
        stored = self.ns.store(tokens, list(want))
        found = self.ns.lookup(tokens)
        if stored != shape.tokens or found != shape.tokens:
            raise RuntimeError(f"tenantkv {suite}: stored {stored}, lookup found {found}")
        self.tokens = tokens
        self.shape = shape

    def restore(self, tokens: list[int], want: Sequence[torch.Tensor]) -> None:
        """Store the prefix again under ``tokens`` (a new prompt with the same KV): the loads of
        :meth:`systems` then load that one (the just-stored mode of ``modes.py``)."""
        stored = self.ns.store(tokens, list(want))
        if stored != self.shape.tokens:
            raise RuntimeError(f"tenantkv {self.suite}: stored {stored} of {self.shape.tokens}")
        self.tokens = tokens

    def systems(self, bufs: Sequence[torch.Tensor], zero: Callable[[], None]) -> list[System]:
        ns, out = self.ns, list(bufs)
        # A codec's rows are a group of their own: the targets compare tenantkv's codec none.
        group = "tenantkv" if self.want is None else "tenantkv-codec"

        def with_out() -> tuple[Loaded, float, float]:
            tokens = self.tokens
            t0 = time.perf_counter()
            first = 0.0
            got: list[torch.Tensor] = []
            with ns.load(tokens, out=out) as stream:
                for _index, layer in stream:
                    if not got:
                        first = time.perf_counter()
                    got.append(layer)
            return got, first - t0, time.perf_counter() - t0

        def fresh_kept() -> tuple[Loaded, float, float]:
            tokens = self.tokens
            t0 = time.perf_counter()
            first = 0.0
            with ns.load(tokens) as stream:
                layers = []
                for _index, layer in stream:
                    if not layers:
                        first = time.perf_counter()
                    layers.append(layer)
            return layers, first - t0, time.perf_counter() - t0

        def check_out(got: Loaded) -> list[list[torch.Tensor]]:
            for mine, theirs in zip(got, out, strict=True):
                if mine.data_ptr() != theirs.data_ptr():
                    raise AssertionError("out= load yielded a tensor that is not the caller's")
            return [[t] for t in got]

        return [
            System(
                f"tenantkv {self.suite}, out=",
                group,
                with_out,
                check_out,
                prepare=zero,
                note="ns.load(tokens, out=bufs)",
                want=self.want,
                stored_bytes=self.stored_bytes,
            ),
            System(
                f"tenantkv {self.suite}, fresh kept",
                group,
                fresh_kept,
                per_layer,
                note="layers = [l for _, l in s]",
                want=self.want,
                stored_bytes=self.stored_bytes,
            ),
        ]

    def close(self) -> None:
        self.kv.close()


def collect() -> None:
    gc.collect()
