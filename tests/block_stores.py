"""Block-store backends for tests: a local directory, Redis, and Redis in front of a directory.

Redis tests use the server at ``TENANTKV_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``),
each under a random key prefix whose keys are deleted afterwards. They are skipped when redis-py
is not installed (the package check installs extras one at a time), and fail, rather than skip,
when the server does not answer: a silent skip would hide breakage.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import pytest

from tenantkv.storage import BlockStore, LocalBlockStore, TieredBlockStore

REDIS_URL = os.environ.get("TENANTKV_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
#: ``local`` maps extents for reading where the file system allows it (the default);
#: ``local-preadv`` reads them with ``preadv`` (``map_reads=False``); ``local-direct`` writes
#: them with ``O_DIRECT``, as a durable store does.
BACKENDS = ("local", "local-preadv", "local-direct", "redis", "tiered")


def redis_client() -> Any:
    """A redis-py client of the test server (skips the test without redis-py)."""
    redis = pytest.importorskip("redis")
    return redis.Redis.from_url(REDIS_URL)


def new_prefix() -> str:
    return f"tkvtest:{secrets.token_hex(6)}:"


def redis_url(prefix: str) -> str:
    return f"{REDIS_URL}?prefix={prefix}"


def drop_prefix(prefix: str) -> None:
    """Delete every key under ``prefix`` (the test's own)."""
    client = redis_client()
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def redis_keys(prefix: str) -> list[bytes]:
    client = redis_client()
    try:
        return sorted(client.scan_iter(match=prefix + "*", count=1000))
    finally:
        client.close()


def make_store(kind: str, root: Path, prefix: str) -> BlockStore:
    """A fresh store of ``kind`` (non-durable: tests) on ``root`` and/or under ``prefix``."""
    if kind in ("local", "local-preadv"):
        return LocalBlockStore(root, durable=False, map_reads=kind == "local")
    if kind == "local-direct":  # O_DIRECT writes, as a durable store makes them
        return LocalBlockStore(root, durable=False, direct=True)
    redis_client().close()  # skip cleanly without redis-py
    from tenantkv.storage.redis_store import RedisBlockStore

    # Tiny chunks and read pieces, so that the machines' small extents span several chunk keys
    # and their range reads several pipelined pieces.
    hot = RedisBlockStore.from_url(redis_url(prefix), chunk_bytes=100, read_piece_bytes=7)
    if kind == "redis":
        return hot
    return TieredBlockStore([hot, LocalBlockStore(root, durable=False)])


def temporaries(store: BlockStore) -> int:
    """How many extents are being written (temporary files or keys)."""
    from_redis = 0
    if isinstance(store, TieredBlockStore):
        return sum(temporaries(tier) for tier in store.tiers[-1:])
    if isinstance(store, LocalBlockStore):
        return len(list(store.temp_dir.glob("*.part")))
    from tenantkv.storage.redis_store import RedisBlockStore

    assert isinstance(store, RedisBlockStore)
    from_redis = len(store.temporary())
    return from_redis
