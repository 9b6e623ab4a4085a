"""LMCache 0.5.6's ``LocalDiskBackend``, driven directly on the CPU, as a peer of tenantkv.

Why directly: an engine integration would add the engine's own costs; this is the storage path
alone. The prefix is stored as LMCache chunks (``chunk_size`` tokens, MLA memory format
``KV_MLA_FMT``: one tensor ``[1, layers, chunk_size, 576]`` per chunk, one ``.pt`` file of raw
bytes per chunk, no encryption), keyed by LMCache's own ``ChunkedTokenDatabase``. A load is
``batched_get_blocking(keys)``: LMCache allocates a ``MemoryObj`` per chunk from its CPU pool
(``LocalCPUBackend``'s allocator) and reads each file into it on its read pool
(``disk_io_threads``, default 4). A chunk holds every layer of its tokens, so the first layer is
usable only when every chunk has arrived: time to first layer = load time.

Setup mirrors LMCache's own tests (``tests/v1/storage_backend/test_local_disk_backend.py``): an
asyncio loop on a daemon thread for the backend's writer, ``LMCacheEngineConfig.from_defaults``,
``LMCacheMetadata`` with ``use_mla=True``. Only importable in bench/peers/.venv.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

CHUNK_TOKENS = 256  # LMCache's default chunk size
MODEL = "deepseek-v3-bench"


def _quiet() -> None:
    """LMCache logs every backend construction at INFO; the benchmark's output is the table."""
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    for name in ("lmcache",):
        logging.getLogger(name).setLevel(logging.ERROR)


def version() -> str:
    from importlib import metadata

    return metadata.version("lmcache")


def _config(disk_dir: Path, disk_bytes: int, cpu_bytes: int) -> Any:
    from lmcache.v1.config import LMCacheEngineConfig

    gib = 1024**3
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS,
        local_cpu=False,  # no hot CPU tier: every get reads the disk backend's files
        max_local_cpu_size=cpu_bytes / gib,  # the pool retrieved chunks are allocated from
        local_disk=str(disk_dir),
        max_local_disk_size=disk_bytes / gib,
        lmcache_instance_id="tenantkv-peers",
    )


def _metadata(layers: int, values_per_token: int, dtype: torch.dtype) -> Any:
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=(layers, 1, CHUNK_TOKENS, 1, values_per_token),
        use_mla=True,
    )


class _Loop:
    """The asyncio loop LocalDiskBackend submits its writes to, on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class LMCachePeer:
    """One LMCache disk cache holding one prefix; ``load()`` retrieves all of its chunks."""

    def __init__(
        self,
        disk_dir: Path,
        layers: int,
        tokens: int,
        values_per_token: int,
        dtype: torch.dtype,
    ) -> None:
        if tokens % CHUNK_TOKENS:
            raise ValueError(f"LMCache peer: tokens must be a multiple of {CHUNK_TOKENS}")
        _quiet()
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
        from lmcache.v1.token_database import ChunkedTokenDatabase

        self.layers, self.tokens, self.dtype = layers, tokens, dtype
        self.chunks = tokens // CHUNK_TOKENS
        chunk_bytes = layers * CHUNK_TOKENS * values_per_token * dtype.itemsize
        prefix_bytes = self.chunks * chunk_bytes
        # The pool must hold a whole retrieved prefix (every chunk is allocated before reading),
        # plus alignment slack.
        self.config = _config(disk_dir, 2 * prefix_bytes + 2**30, prefix_bytes + 2 * chunk_bytes)
        self.metadata = _metadata(layers, values_per_token, dtype)
        self._loop = _Loop()
        self.cpu = LocalCPUBackend(self.config, self.metadata, dst_device="cpu")
        self.disk = LocalDiskBackend(
            self.config, self._loop.loop, self.cpu, dst_device="cpu", metadata=self.metadata
        )
        self.token_db = ChunkedTokenDatabase(self.config, self.metadata)
        self.keys: list[Any] = []

    def chunk_keys(self, tokens: torch.Tensor) -> list[Any]:
        """LMCache's keys for a prompt: ``ChunkedTokenDatabase.process_tokens`` (chained hashes)."""
        return [key for _start, _end, key in self.token_db.process_tokens(tokens)]

    def store(self, tokens: torch.Tensor, layers: Sequence[torch.Tensor]) -> None:
        """Store the prefix as chunks (untimed set-up) and wait until every write has landed."""
        from lmcache.v1.memory_management import MemoryFormat

        self.keys = self.chunk_keys(tokens)
        if len(self.keys) != self.chunks:
            raise RuntimeError(f"LMCache made {len(self.keys)} keys, expected {self.chunks}")
        shape = self.metadata.get_shapes(CHUNK_TOKENS)[0]  # [1, layers, chunk, 576]
        for c, key in enumerate(self.keys):
            obj = self.cpu.allocate(shape, self.dtype, MemoryFormat.KV_MLA_FMT)
            if obj is None:
                raise RuntimeError("LMCache's CPU pool could not allocate a chunk to store")
            rows = slice(c * CHUNK_TOKENS, (c + 1) * CHUNK_TOKENS)
            for layer, src in enumerate(layers):
                obj.tensor[0, layer].copy_(src[rows])
            self.disk.batched_submit_put_task([key], [obj])
            obj.ref_count_down()  # the put task holds its own reference until written
        deadline = time.monotonic() + 600
        while not all(self.disk.contains(k) for k in self.keys):
            if time.monotonic() > deadline:
                raise RuntimeError("LMCache's disk writes did not finish in 10 minutes")
            time.sleep(0.005)

    def load(self) -> list[Any]:
        """Retrieve every chunk into CPU memory (LMCache's own allocation and read pool)."""
        objs = self.disk.batched_get_blocking(self.keys)
        if any(o is None for o in objs):
            raise RuntimeError("LMCache returned a miss for a stored chunk")
        return list(objs)

    @staticmethod
    def release(objs: Sequence[Any]) -> None:
        """Give the chunks back to LMCache's pool (as its retrieve path does after use)."""
        for obj in objs:
            obj.ref_count_down()

    def layer_views(self, objs: Sequence[Any], layer: int) -> list[torch.Tensor]:
        """Layer ``layer`` of the loaded prefix, one ``[chunk, 576]`` view per chunk."""
        return [obj.tensor[0, layer] for obj in objs]

    def contains_prefix(self, keys: Sequence[Any]) -> int:
        """How many leading chunks are on disk: LMCache's lookup after hashing."""
        n = 0
        for key in keys:
            if not self.disk.contains(key):
                break
            n += 1
        return n

    def close(self) -> None:
        self.disk.close()
        self._loop.stop()
        allocator = getattr(self.cpu, "memory_allocator", None)
        if allocator is not None and hasattr(allocator, "close"):
            allocator.close()
