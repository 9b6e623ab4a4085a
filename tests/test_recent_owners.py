"""Rings of recent writes per owner (tenantkv.storage.recent_owners): one tenant's stores never
push another tenant's just-written extents out of memory; the budget follows the memory
available; and cold reads of local extents read ahead where the kernel does not
(tenantkv.storage.local_reader)."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest
import torch

import tenantkv
from tenantkv.config import CacheConfig
from tenantkv.errors import InvalidRequestError
from tenantkv.storage import local_reader
from tenantkv.storage.local import LocalBlockStore
from tenantkv.storage.local_reader import (
    READ_AHEAD_BYTES,
    READ_AHEAD_STEP,
    LocalReader,
    _in_page_cache,
)
from tenantkv.storage.recent_owners import (
    MAX_DEFAULT_CAPACITY,
    OwnerRings,
    default_capacity,
    default_per_owner,
)
from tests.helpers import MHA_SMALL, random_layers, random_tokens

PAGE = mmap.PAGESIZE
GiB = 1 << 30


def _write(store: LocalBlockStore, data: bytes, owner: str) -> str:
    with store.create(owner) as writer:
        writer.reserve(len(data))
        out = writer.scratch(0, len(data))
        out[:] = data
        writer.write_at(0, out)
        return writer.commit()


def _read(store: LocalBlockStore, extent_id: str) -> tuple[bytes, bool]:
    """The extent's bytes, and whether they came out of a ring (``map_reads=False``: only a
    ring's reader has a mapping)."""
    with store.open(extent_id) as reader:
        buffer = bytearray(reader.size)
        reader.readinto(0, [buffer])
        return bytes(buffer), reader.mapped() is not None


def _store(root: Path, capacity: int, per_owner: int) -> LocalBlockStore:
    store = LocalBlockStore(
        root,
        durable=True,
        direct=True,
        map_reads=False,
        recent_bytes=capacity,
        recent_owner_bytes=per_owner,
    )
    if store.recent is None:
        pytest.skip("this platform has no O_DIRECT")
    return store


def test_one_owners_stores_never_push_anothers_extent_out(tmp_path: Path) -> None:
    store = _store(tmp_path / "blocks", 8 * PAGE, 4 * PAGE)
    try:
        theirs = os.urandom(2 * PAGE)
        kept = _write(store, theirs, "b")
        mine = [_write(store, os.urandom(2 * PAGE), "a") for _ in range(5)]  # wraps a's ring
        assert _read(store, kept) == (theirs, True)  # b's extent is still in memory
        assert _read(store, mine[-1])[1]  # control: a's last extent is in its ring too
        first, from_ring = _read(store, mine[0])
        assert not from_ring  # a's own stores pushed a's first extent out ...
        assert first == store.path_of(mine[0]).read_bytes()  # ... and the file serves it
    finally:
        store.close()


def test_one_shared_ring_lets_a_large_store_push_others_out(tmp_path: Path) -> None:
    """The control of the test above: with one ring for all (each owner's share the whole
    budget, so one owner holds it), the same stores do push b's extent out."""
    store = _store(tmp_path / "blocks", 8 * PAGE, 8 * PAGE)
    try:
        kept = _write(store, os.urandom(2 * PAGE), "")
        assert _read(store, kept)[1]
        for _ in range(5):
            _write(store, os.urandom(2 * PAGE), "")
        assert not _read(store, kept)[1]
    finally:
        store.close()


def test_a_new_owner_gets_the_ring_idle_longest_never_one_in_use(tmp_path: Path) -> None:
    store = _store(tmp_path / "blocks", 8 * PAGE, 4 * PAGE)  # two rings
    rings = store.recent
    assert isinstance(rings, OwnerRings) and rings.max_rings == 2
    try:
        old = _write(store, os.urandom(PAGE), "a")
        recent = _write(store, os.urandom(PAGE), "b")
        assert _read(store, old)[1]  # a's ring used after b's: b's is now idle longest
        third = _write(store, os.urandom(PAGE), "c")
        assert rings.reassigned == 1 and rings.ring_of("b") is None
        assert _read(store, third)[1] and _read(store, old)[1]  # c and a are in memory
        data, from_ring = _read(store, recent)
        assert not from_ring and data == store.path_of(recent).read_bytes()
        # A ring with a reader open is never taken: d's extent is left out instead.
        with store.open(third) as reading, store.open(old) as also_reading:
            assert reading.mapped() is not None and also_reading.mapped() is not None
            left_out = rings.left_out
            fourth = _write(store, os.urandom(PAGE), "d")
            assert rings.left_out == left_out + 1
        assert not _read(store, fourth)[1]
        assert _read(store, third)[1] and _read(store, old)[1]
    finally:
        store.close()


def test_the_budget_follows_the_memory_available() -> None:
    assert default_capacity(8 * GiB) == GiB
    assert default_capacity(1024 * GiB) == MAX_DEFAULT_CAPACITY
    assert default_capacity(3) == PAGE  # never zero: a page at least
    assert default_per_owner(16 * GiB) == 2 * GiB  # eight owners at once
    assert default_per_owner(2 * GiB) == GiB  # an 8K-token prefix still fits one ring
    assert default_per_owner(256 << 20) == 256 << 20


def test_the_settings_and_their_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CacheConfig().recent_writes_bytes is None  # derived when the cache opens
    monkeypatch.setenv("TENANTKV_RECENT_WRITES_BYTES", "auto")
    monkeypatch.setenv("TENANTKV_RECENT_WRITES_TENANT_BYTES", "8192")
    config = CacheConfig.from_env()
    assert config.recent_writes_bytes is None and config.recent_writes_tenant_bytes == 8192
    auto = CacheConfig(recent_writes_bytes="auto", recent_writes_tenant_bytes="auto")  # type: ignore[arg-type]
    assert auto.recent_writes_bytes is None and auto.recent_writes_tenant_bytes is None
    for bad in (0, -1, 1.5, True, "big"):
        with pytest.raises(InvalidRequestError, match="recent_writes_tenant_bytes"):
            CacheConfig(recent_writes_tenant_bytes=bad)  # type: ignore[arg-type]


def test_a_cache_keeps_each_tenants_stores_in_a_ring_of_its_own(
    tmp_path: Path, index: object
) -> None:
    tokens = random_tokens(64)
    layers = random_layers(MHA_SMALL, 64, seed=1)
    # One ring for both (a tenant's share the whole budget: the old behaviour): the large
    # tenant's stores take it. With a ring each (512 KiB per tenant), the small tenant's store
    # stays in memory, and its load reads it there.
    for per_tenant, kept in ((1 << 20, False), (1 << 19, True)):
        with tenantkv.open(
            tmp_path / f"cache-{per_tenant}",
            map_reads=False,
            recent_writes_bytes=1 << 20,
            recent_writes_tenant_bytes=per_tenant,
        ) as kv:
            store = kv.context.blocks
            assert isinstance(store, LocalBlockStore) and store.recent is not None
            kv.create_tenant("small")
            kv.create_tenant("large")
            small = kv.namespace("small", model="m", layout=MHA_SMALL)
            large = kv.namespace("large", model="m", layout=MHA_SMALL)
            assert small.store(tokens, layers) == 64
            for seed in range(4):
                large.store(random_tokens(2048, seed=10 + seed), random_layers(MHA_SMALL, 2048))
            served = store.recent.served
            with small.load(tokens) as stream:
                got = [layer for _, layer in stream]
            assert (store.recent.served > served) is kept
            for layer, want in zip(got, layers, strict=True):
                assert torch.equal(layer[0], want[0]) and torch.equal(layer[1], want[1])


def _cold_extent(tmp_path: Path) -> tuple[LocalBlockStore, str, bytes]:
    """An extent written past the page cache and dropped from it (skips where it cannot be)."""
    store = LocalBlockStore(tmp_path / "blocks", durable=True, map_reads=False, recent_bytes=0)
    data = os.urandom(3 * PAGE + 5)
    extent_id = _write(store, data, "a")
    fd = os.open(store.path_of(extent_id), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if _in_page_cache(fd, len(data)):
            pytest.skip("this file system keeps the file's pages (no way to read it cold)")
        # The probe's misses may start the kernel's readahead: let it land, then drop again.
        time.sleep(0.1)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return store, extent_id, data


def test_a_cold_extent_is_read_ahead_and_a_warm_one_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, extent_id, data = _cold_extent(tmp_path)
    monkeypatch.setattr(local_reader, "device_read_ahead_bytes", lambda device: 128 << 10)
    with store.open(extent_id) as reader:
        assert isinstance(reader, LocalReader) and reader.cold() and reader.advises_read_ahead
        buffer = bytearray(len(data))
        reader.readinto(0, [buffer])
        assert bytes(buffer) == data
    with store.open(extent_id) as reader:  # control: now in the page cache
        assert isinstance(reader, LocalReader) and not reader.cold()
        assert not reader.advises_read_ahead
        buffer = bytearray(len(data))
        reader.readinto(0, [buffer])
        assert bytes(buffer) == data
    assert READ_AHEAD_BYTES >= 16 << 20


def test_a_cold_extent_is_not_advised_where_the_kernel_reads_a_step_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Advice fills the page cache in single pages, which later warm reads pay for: where the
    device's own read-ahead (doubled for sequential reads) covers a step, none is given."""
    store, extent_id, data = _cold_extent(tmp_path)
    monkeypatch.setattr(local_reader, "device_read_ahead_bytes", lambda device: 8 << 20)
    with store.open(extent_id) as reader:
        assert isinstance(reader, LocalReader) and reader.cold()
        assert not reader.advises_read_ahead
        buffer = bytearray(len(data))
        reader.readinto(0, [buffer])
        assert bytes(buffer) == data


def test_read_ahead_advice_follows_the_devices_window() -> None:
    assert local_reader.needs_read_ahead_advice(None)  # unknown: advise, as always before
    assert local_reader.needs_read_ahead_advice(128 << 10)  # a device's usual window
    assert local_reader.needs_read_ahead_advice(READ_AHEAD_STEP // 2 - 4096)
    assert not local_reader.needs_read_ahead_advice(READ_AHEAD_STEP // 2)
    assert not local_reader.needs_read_ahead_advice(8 << 20)
    # A device number no system has: its window cannot be told.
    assert local_reader.device_read_ahead_bytes(os.makedev(4000, 999_999)) is None


def test_the_window_of_a_real_device_is_read_from_sysfs(tmp_path: Path) -> None:
    device = os.stat(tmp_path).st_dev
    bdi = Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb")
    if not bdi.exists():
        pytest.skip("the temp dir's file system has no backing device of its own in sysfs")
    want = int(bdi.read_text().strip()) * 1024
    assert local_reader.device_read_ahead_bytes(device) == want
