"""Storage faults degrade to a miss or a typed error, never to lost or wrong data.

The faults are injected by a real local block store whose operations can be made to fail the way
a full disk or a broken mount fails (OSError inside the backend), so everything above the store
runs for real.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from typing_extensions import Buffer

import tenantkv
from tenantkv.storage import ExtentReader, ExtentWriter, LocalBlockStore, StorageError
from tests.helpers import MLA_SMALL, layers_equal, load_all, random_layers, random_tokens
from tests.indexes import Index


class FaultyStore(LocalBlockStore):
    """A LocalBlockStore whose open/write can be switched to fail like a broken disk."""

    fail_open = False
    fail_write = False

    def open(self, extent_id: str) -> ExtentReader:
        if self.fail_open:
            raise StorageError(f"opening extent failed: {os.strerror(errno.EMFILE)}")
        return super().open(extent_id)

    def create(self, owner: str = "") -> ExtentWriter:
        writer = super().create(owner)
        if not self.fail_write:
            return writer
        real_write_at = writer.write_at
        calls = 0

        def write_at(offset: int, data: Buffer) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:  # the header fits; the disk fills up on the first layer
                real_write_at(offset, data)
                return
            real_write_at(offset, memoryview(data)[:1])
            writer.abort()
            raise StorageError(f"writing extent failed: {os.strerror(errno.ENOSPC)}")

        writer.write_at = write_at  # type: ignore[method-assign]
        return writer


@pytest.fixture(params=["buffered", "direct"])
def faulty(request: pytest.FixtureRequest, tmp_path: Path, index: Index) -> FaultyStore:
    """The faulty store writing through the page cache, and as a durable store writes
    (fsync, O_DIRECT and a reserved extent)."""
    if request.param == "direct":
        return FaultyStore(tmp_path / "cache" / "blocks", direct=True)
    return FaultyStore(tmp_path / "cache" / "blocks", durable=False)


def _open(tmp_path: Path, store: FaultyStore, strict: bool = False) -> tenantkv.TenantKV:
    return tenantkv.open(tmp_path / "cache", block_store=store, strict=strict)


def test_io_error_on_load_is_a_degraded_miss_and_keeps_the_extent(
    tmp_path: Path, faulty: FaultyStore
) -> None:
    """An I/O error opening an extent (EMFILE here; Redis down alike) is the store's outage:
    a miss counted as ``degraded_load``, as for an index outage, not a LoadError in the
    serving path; the extent stays indexed and loads again once the store recovers."""
    tokens, layers = random_tokens(128), random_layers(MLA_SMALL, 128)
    with _open(tmp_path, faulty) as kv:
        kv.create_tenant("acme")
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        ns.store(tokens, layers)
        faulty.fail_open = True
        with pytest.raises(tenantkv.CacheMissError, match="block store unavailable"):
            ns.load(tokens)
        assert kv.health_counters().get("degraded_load", 0) == 1
        assert kv.security_events() == {}  # an I/O error is not evidence of tampering
        faulty.fail_open = False
        assert ns.lookup(tokens) == 128  # nothing was dropped
        for got, want in zip(load_all(ns, tokens), layers, strict=True):
            assert layers_equal(got, want)


def test_io_error_on_a_strict_load_is_unavailable(tmp_path: Path, faulty: FaultyStore) -> None:
    tokens, layers = random_tokens(128), random_layers(MLA_SMALL, 128)
    with _open(tmp_path, faulty, strict=True) as kv:
        kv.create_tenant("acme")
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        ns.store(tokens, layers)
        faulty.fail_open = True
        with pytest.raises(tenantkv.CacheUnavailableError, match="load failed"):
            ns.load(tokens)
        faulty.fail_open = False
        assert len(load_all(ns, tokens)) == MLA_SMALL.num_layers  # positive control


def test_full_disk_on_store_stores_nothing_and_leaves_nothing(
    tmp_path: Path, faulty: FaultyStore
) -> None:
    tokens, layers = random_tokens(192), random_layers(MLA_SMALL, 192)
    with _open(tmp_path, faulty) as kv:
        kv.create_tenant("acme")
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        faulty.fail_write = True
        assert ns.store(tokens, layers) == 0  # degrades to "nothing stored"
        assert ns.lookup(tokens) == 0
        assert kv.info()["extents"] == 0 and kv.info()["blocks"] == 0
        assert list(faulty.list()) == []
        assert list(faulty.temp_dir.iterdir()) == []
        faulty.fail_write = False
        assert ns.store(tokens, layers) == 192  # positive control: the disk is back
        assert ns.lookup(tokens) == 192


def test_strict_mode_raises_cache_unavailable(tmp_path: Path, faulty: FaultyStore) -> None:
    tokens, layers = random_tokens(64), random_layers(MLA_SMALL, 64)
    with _open(tmp_path, faulty, strict=True) as kv:
        kv.create_tenant("acme")
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        faulty.fail_write = True
        with pytest.raises(tenantkv.CacheUnavailableError, match="store failed"):
            ns.store(tokens, layers)
        assert kv.info()["extents"] == 0


@pytest.mark.usefixtures("index")
def test_index_failure_on_lookup_degrades_to_a_miss(tmp_path: Path) -> None:
    tokens, layers = random_tokens(64), random_layers(MLA_SMALL, 64)
    with tenantkv.open(tmp_path / "cache", durable=False) as kv:
        kv.create_tenant("acme")
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        ns.store(tokens, layers)
        assert ns.lookup(tokens) == 64
        with kv.context.index.engine.begin() as connection:  # the index loses its tables
            connection.exec_driver_sql("ALTER TABLE tkv_blocks RENAME TO tkv_blocks_lost")
        assert ns.lookup(tokens) == 0
        with kv.context.index.engine.begin() as connection:
            connection.exec_driver_sql("ALTER TABLE tkv_blocks_lost RENAME TO tkv_blocks")
        assert ns.lookup(tokens) == 64


@pytest.mark.usefixtures("index")
def test_an_index_outage_is_counted_not_billed_and_the_same_for_every_operation(
    tmp_path: Path,
) -> None:
    tokens, layers = random_tokens(128), random_layers(MLA_SMALL, 128)
    with tenantkv.open(tmp_path / "cache", durable=False) as kv:
        kv.create_tenant("acme")
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        ns.store(tokens[:64], [layer[:64] for layer in layers])
        assert ns.lookup(tokens) == 64  # control: metered as 64 hit and 64 missed tokens
        with kv.context.index.engine.begin() as connection:  # the index loses its tables
            connection.exec_driver_sql("ALTER TABLE tkv_blocks RENAME TO tkv_blocks_lost")
        assert ns.lookup(tokens) == 0
        assert ns.cached_length(tokens) == 0
        assert ns.prefetch(tokens) == 0
        assert ns.store(tokens, layers) == 0
        with pytest.raises(tenantkv.CacheMissError, match="index unavailable"):
            ns.load(tokens[:64])
        with kv.context.index.engine.begin() as connection:
            connection.exec_driver_sql("ALTER TABLE tkv_blocks_lost RENAME TO tkv_blocks")
        usage = kv.usage("acme").counters
        assert usage["hit_tokens"] == 64 and usage["miss_tokens"] == 64  # the outage is not billed
        health = kv.health_counters()
        for operation in ("lookup", "cached_length", "prefetch", "store", "load"):
            assert health[f"degraded_{operation}"] == 1, operation
        assert kv.security_events() == {}
        assert ns.lookup(tokens) == 64  # recovered by itself


@pytest.mark.usefixtures("index")
def test_strict_mode_raises_the_same_error_for_every_operation(tmp_path: Path) -> None:
    tokens, layers = random_tokens(64), random_layers(MLA_SMALL, 64)
    with tenantkv.open(tmp_path / "cache", durable=False, strict=True) as kv:
        kv.create_tenant("acme")
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        ns.store(tokens, layers)
        with kv.context.index.engine.begin() as connection:
            connection.exec_driver_sql("ALTER TABLE tkv_blocks RENAME TO tkv_blocks_lost")
        for name, call in [
            ("lookup", lambda: ns.lookup(tokens)),
            ("cached_length", lambda: ns.cached_length(tokens)),
            ("prefetch", lambda: ns.prefetch(tokens)),
            ("store", lambda: ns.store(random_tokens(64, seed=9), layers)),
            ("load", lambda: ns.load(tokens)),
        ]:
            with pytest.raises(tenantkv.CacheUnavailableError, match=f"{name} failed"):
                call()
        with kv.context.index.engine.begin() as connection:
            connection.exec_driver_sql("ALTER TABLE tkv_blocks_lost RENAME TO tkv_blocks")
        assert ns.lookup(tokens) == 64
