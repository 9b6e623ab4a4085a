"""A cache on Redis and on Redis in front of a directory, against the real server.

Positive controls first: every test stores a prefix and loads it back byte-exact before it
evicts, kills or scans anything, so none passes by the cache storing nothing. Each test keeps its
keys under a random prefix of its own and deletes them at the end (tests/block_stores.py).
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tenantkv
from tenantkv import TenantKV
from tenantkv.retention import MAX_RETENTION
from tenantkv.storage import BlockStoreUrlError, TieredBlockStore, open_block_store
from tests.block_stores import (
    REDIS_URL,
    drop_prefix,
    new_prefix,
    redis_client,
    redis_keys,
    redis_url,
)
from tests.indexes import Index

from .helpers import MLA_SMALL, ManualClock, load_all, random_layers
from .test_at_rest import TOKENS, bytes_of, canary_layers, canary_needles, token_needles

pytest.importorskip("redis")
from tenantkv.storage.redis_store import DEFAULT_TTL  # after the skip: it needs redis-py

NUM_TOKENS = len(TOKENS)


@pytest.fixture
def prefix() -> Iterator[str]:
    name = new_prefix()
    try:
        yield name
    finally:
        drop_prefix(name)


def _url(kind: str, prefix: str, root: Path) -> str:
    hot = redis_url(prefix)
    return hot if kind == "redis" else f"{hot},{(root / 'cold').resolve().as_uri()}"


def _open(root: Path, url: str) -> TenantKV:
    return tenantkv.open(root, durable=False, block_store_url=url)


def _store(kv: TenantKV, *, canaries: bool = False) -> tuple[Any, list[Any]]:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    layers = (
        canary_layers(MLA_SMALL, NUM_TOKENS)[0]
        if canaries
        else random_layers(MLA_SMALL, NUM_TOKENS)
    )
    assert ns.store(TOKENS, layers) == NUM_TOKENS
    return ns, layers


def _loads_exactly(ns: Any, layers: list[Any]) -> bool:
    return [bytes_of(x) for x in load_all(ns, TOKENS)] == [bytes_of(x) for x in layers]


def _extent_keys(prefix: str) -> list[bytes]:
    """Every committed extent's keys: its header and its chunks."""
    return [k for k in redis_keys(prefix) if b"tmp:" not in k]


def _extents(prefix: str) -> list[bytes]:
    """One key per committed extent (its header)."""
    return [k for k in _extent_keys(prefix) if b":" not in k[len(prefix) :]]


@pytest.mark.parametrize("kind", ["redis", "tiered"])
def test_cache_on_redis_round_trips_and_keeps_no_plaintext(
    tmp_path: Path, prefix: str, kind: str, index: Index
) -> None:
    with _open(tmp_path / "cache", _url(kind, prefix, tmp_path)) as kv:
        ns, layers = _store(kv, canaries=True)
        assert ns.lookup(TOKENS) == NUM_TOKENS
        assert _loads_exactly(ns, layers)  # positive control
        if kind == "tiered" and kv.metrics_registry is not None:  # tier hits reach the metrics
            hot_hits = kv.metrics_registry.get_sample_value(
                "tenantkv_tier_hits_total", {"tier": "tier0"}
            )
            assert hot_hits is not None and hot_hits >= 1
        keys = _extent_keys(prefix)
        assert len(_extents(prefix)) == 1  # the extent is in Redis ...
        client = redis_client()
        try:
            values = [client.get(k) or b"" for k in keys]
            assert all(client.ttl(k) > 0 for k in keys)  # ... and expires (the store's TTL)
        finally:
            client.close()
    needles = {
        **token_needles(TOKENS),
        "canary": canary_needles(canary_layers(MLA_SMALL, NUM_TOKENS)[1]),
    }
    blob = b"\n".join(keys + values)
    assert sum(len(v) for v in values) > NUM_TOKENS * MLA_SMALL.token_bytes
    leaks = [kind for kind, group in needles.items() if any(n in blob for n in group)]
    assert leaks == []
    # Key names are the prefix, the store's random id and a chunk number, nothing else.
    assert all(re.fullmatch(r"[0-9a-f]{32}(:[0-9]+)?", k.decode()[len(prefix) :]) for k in keys)


@pytest.mark.parametrize("kind", ["redis", "tiered"])
def test_evicted_key_is_a_lost_extent_not_a_security_event(
    tmp_path: Path, prefix: str, kind: str, index: Index
) -> None:
    with _open(tmp_path / "cache", _url(kind, prefix, tmp_path)) as kv:
        ns, layers = _store(kv)
        assert _loads_exactly(ns, layers)  # positive control
        client = redis_client()
        try:
            assert client.delete(*_extent_keys(prefix)) == 2  # what maxmemory eviction does
        finally:
            client.close()
        if kind == "tiered":  # the cold tier serves it: a hot miss, no loss
            assert _loads_exactly(ns, layers)
            assert kv.health_counters().get("lost_extents", 0) == 0
            blocks = kv._ctx.blocks
            assert isinstance(blocks, TieredBlockStore)
            blocks.wait_for_promotions()
            assert blocks.stats()["tier0"]["misses"] >= 1
            assert blocks.stats()["tier0"]["promotions"] == 1
            assert len(_extents(prefix)) == 1  # promoted back into Redis
        else:
            with pytest.raises(tenantkv.CacheMissError):
                ns.load(TOKENS)
            assert ns.lookup(TOKENS) == 0
            assert kv.health_counters()["lost_extents"] == 1
        assert kv.security_events() == {}


def _kill_store_connections() -> int:
    """``CLIENT KILL`` every normal connection but our own; return how many were killed."""
    client = redis_client()
    try:
        own = client.client_id()
        killed = 0
        for info in client.client_list(_type="normal"):
            if int(info["id"]) != own:
                killed += int(client.client_kill_filter(_id=int(info["id"])))
        return killed
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["redis", "tiered"])
def test_client_kill_mid_run_then_recovery(
    tmp_path: Path, prefix: str, kind: str, index: Index, caplog: pytest.LogCaptureFixture
) -> None:
    with _open(tmp_path / "cache", _url(kind, prefix, tmp_path)) as kv:
        ns, layers = _store(kv)
        assert _loads_exactly(ns, layers)  # positive control: connections are pooled now
        delivered: list[Any] = []
        try:  # a load running while its connections are killed: it finishes, or fails typed
            with ns.load(TOKENS) as stream:
                for _, layer in stream:
                    if not delivered:
                        assert _kill_store_connections() >= 1
                    delivered.append(layer)
        except tenantkv.LoadError:
            assert kind == "redis"  # the tiered store finishes from the cold tier
        expected = [bytes_of(x) for x in layers]
        assert [bytes_of(x) for x in delivered] == expected[: len(delivered)]  # never wrong
        if kind == "tiered":
            assert len(delivered) == len(layers)
        _kill_store_connections()
        assert _loads_exactly(ns, layers)  # the pool reconnected by itself
        assert kv.security_events() == {}


class _Gate:
    """A TCP proxy to Redis that can refuse connections (the server 'goes away') and let them
    through again, so an outage needs no server of our own."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.open = True
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def refuse(self) -> None:
        self.open = False
        with self._lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()

    def close(self) -> None:
        self.refuse()
        self._listener.close()


def test_redis_refusing_connections_degrades_then_recovers(
    tmp_path: Path, prefix: str, index: Index, caplog: pytest.LogCaptureFixture
) -> None:
    gate = _Gate(("127.0.0.1", 6379))
    url = f"redis://127.0.0.1:{gate.port}/0?prefix={prefix}&socket_timeout=2"
    try:
        with _open(tmp_path / "cache", url) as kv:
            ns, layers = _store(kv)
            assert _loads_exactly(ns, layers)  # positive control
            gate.refuse()
            with caplog.at_level(logging.WARNING, logger="tenantkv"):
                other = random_layers(MLA_SMALL, NUM_TOKENS, seed=5)
                assert ns.store([t + 1 for t in TOKENS], other) == 0  # skipped, logged
                with pytest.raises(tenantkv.CacheMissError):
                    ns.load(TOKENS)  # a miss, as docs/README say, not a LoadError; bytes kept
            assert kv.health_counters().get("degraded_store", 0) == 1
            assert kv.health_counters().get("degraded_load", 0) == 1
            assert any("store" in r.getMessage() for r in caplog.records)
            assert kv.security_events() == {}
            gate.open = True
            assert ns.lookup(TOKENS) == NUM_TOKENS  # the index kept it: the bytes were fine
            assert _loads_exactly(ns, layers)  # recovered by itself
            assert ns.store([t + 1 for t in TOKENS], other) == NUM_TOKENS
    finally:
        gate.close()


def test_strict_load_with_redis_unreachable_raises_unavailable(
    tmp_path: Path, prefix: str, index: Index
) -> None:
    """``strict=True`` turns the same outage into CacheUnavailableError, not a miss."""
    gate = _Gate(("127.0.0.1", 6379))
    url = f"redis://127.0.0.1:{gate.port}/0?prefix={prefix}&socket_timeout=2"
    try:
        with tenantkv.open(
            tmp_path / "cache", durable=False, block_store_url=url, strict=True
        ) as kv:
            ns, layers = _store(kv)
            assert _loads_exactly(ns, layers)  # positive control
            gate.refuse()
            with pytest.raises(tenantkv.CacheUnavailableError, match="load failed"):
                ns.load(TOKENS)
            assert kv.health_counters().get("degraded_load", 0) == 0  # raised, not degraded
            gate.open = True
            assert _loads_exactly(ns, layers)
    finally:
        gate.close()


def test_tiered_store_survives_a_hot_tier_outage(tmp_path: Path, prefix: str) -> None:
    gate = _Gate(("127.0.0.1", 6379))
    hot = f"redis://127.0.0.1:{gate.port}/0?prefix={prefix}&socket_timeout=2"
    store = open_block_store(f"{hot},{(tmp_path / 'cold').as_uri()}", durable=False)
    assert isinstance(store, TieredBlockStore)
    store.hot_retry_s = 0.0  # try Redis on every call, so each call below meets the outage
    try:
        with store.create() as writer:
            writer.write(b"sealed bytes")
            extent_id = writer.commit()
        assert len(_extents(prefix)) == 1  # written through to both tiers
        gate.refuse()
        buffer = bytearray(12)
        with store.open(extent_id) as reader:
            reader.readinto(0, [buffer])
        assert buffer == b"sealed bytes"
        with store.create() as writer:  # stores go on, cold only
            writer.write(b"more")
            second = writer.commit()
        assert store.stats()["tier0"]["errors"] >= 1
        assert store.stats()["tier0"]["write_errors"] >= 1
        gate.open = True
        with store.open(second) as reader:  # cold hit, promoted once Redis answers
            reader.readinto(0, [buffer[:4]])
        store.wait_for_promotions()
        assert store.stats()["tier0"]["promotions"] == 1
        assert len(_extents(prefix)) == 2
    finally:
        store.close()
        gate.close()


@pytest.mark.parametrize(
    "url",
    [
        "ftp://host/x",
        "redis://",
        "file:///a,",
        "redis://127.0.0.1:6379/0,redis://127.0.0.1:6379/1",
        "file://relative/dir",
    ],
)
def test_bad_block_store_urls_are_refused(url: str) -> None:
    with pytest.raises(BlockStoreUrlError):
        open_block_store(url)
    with pytest.raises(tenantkv.InvalidRequestError):
        tenantkv.CacheConfig(block_store_url=url)


@pytest.mark.parametrize("ttl", ["-1", "soon", "inf", "nan", "1&ttl=2"])
def test_bad_redis_ttls_are_refused(ttl: str) -> None:
    with pytest.raises(BlockStoreUrlError):
        open_block_store(f"{REDIS_URL}?ttl={ttl}")


def _pttls(prefix: str) -> dict[bytes, int]:
    """Every committed extent key's remaining TTL, in milliseconds (-1: none)."""
    client = redis_client()
    try:
        return {k: int(client.pttl(k)) for k in _extent_keys(prefix)}
    finally:
        client.close()


def _spread(ttls: dict[bytes, int]) -> int:
    return max(ttls.values()) - min(ttls.values())


#: TTLs set by one fixed rule differ only by when their extents were committed: well under this.
SAME_TTL_MS = 60_000


def test_the_default_ttl_outlasts_every_retention() -> None:
    """A Redis store used alone must not forget an extent the index still serves."""
    assert DEFAULT_TTL >= MAX_RETENTION


@pytest.mark.parametrize("kind", ["redis", "tiered"])
def test_redis_ttls_do_not_tell_retention_classes_apart(
    tmp_path: Path, prefix: str, kind: str, index: Index
) -> None:
    """Whoever reads the Redis keys reads their TTLs. A TTL set from the extent's retention
    sorted the extents by tenant (tenants choose their classes): three extents of classes of
    1 h, 2 h and 30 d, of two tenants, must get TTLs that a reader cannot tell apart, and keep
    them when a class is lengthened. Control: each extent is still served."""
    with _open(tmp_path / "cache", _url(kind, prefix, tmp_path)) as kv:
        kv.create_tenant("acme", retention={"agent": "1h", "chat": "2h"})
        kv.create_tenant("globex", retention={"chat": "30d"})
        acme = kv.namespace("acme", model="m", layout=MLA_SMALL)
        globex = kv.namespace("globex", model="m", layout=MLA_SMALL)
        layers = random_layers(MLA_SMALL, NUM_TOKENS)
        other = [t + 1 for t in TOKENS]
        assert acme.store(TOKENS, layers, kind="agent") == NUM_TOKENS
        assert acme.store(other, layers, kind="chat") == NUM_TOKENS
        assert globex.store(TOKENS, layers, kind="chat") == NUM_TOKENS
        # (no load before the TTLs are read: a load restarts its extent's TTL in the background)
        before = _pttls(prefix)
        assert len(_extents(prefix)) == 3 and len(before) == 6  # a header and a chunk each
        assert _spread(before) < SAME_TTL_MS, before
        assert min(before.values()) > (DEFAULT_TTL - 60) * 1000  # the store's, not a class's
        kv.update_tenant("acme", retention={"agent": "30d"})
        after = _pttls(prefix)
        assert _spread(after) < SAME_TTL_MS, after
        # Positive control: every extent is still served, byte-exact.
        assert acme.lookup(TOKENS) == NUM_TOKENS and _loads_exactly(acme, layers)
        assert acme.lookup(other) == NUM_TOKENS
        assert [bytes_of(x) for x in load_all(acme, other)] == [bytes_of(x) for x in layers]
        assert globex.lookup(TOKENS) == NUM_TOKENS and _loads_exactly(globex, layers)


def test_a_configured_ttl_is_used_for_every_class(
    tmp_path: Path, prefix: str, index: Index
) -> None:
    """``?ttl=`` sets every extent's TTL: shorter than every class here, and not raised to
    any of them (a hot tier is a cache of the directory, which keeps the extents)."""
    url = f"{redis_url(prefix)}&ttl=120,{(tmp_path / 'cold').resolve().as_uri()}"
    with _open(tmp_path / "cache", url) as kv:
        kv.create_tenant("acme", retention={"agent": "1h"})
        kv.create_tenant("globex", retention={"chat": "30d"})
        acme = kv.namespace("acme", model="m", layout=MLA_SMALL)
        globex = kv.namespace("globex", model="m", layout=MLA_SMALL)
        layers = random_layers(MLA_SMALL, NUM_TOKENS)
        assert acme.store(TOKENS, layers, kind="agent") == NUM_TOKENS
        assert globex.store(TOKENS, layers, kind="chat") == NUM_TOKENS
        ttls = _pttls(prefix)
        assert len(_extents(prefix)) == 2
        assert all(60_000 < ttl <= 120_000 for ttl in ttls.values()), ttls
        assert _loads_exactly(acme, layers) and _loads_exactly(globex, layers)  # control


def test_a_promoted_copy_gets_the_same_ttl(tmp_path: Path, prefix: str, index: Index) -> None:
    """A copy promoted from the directory gets the TTL a fresh store gets (it had none: it
    stayed until GC deleted it, and its missing TTL set it apart from fresh ones)."""
    with _open(tmp_path / "cache", _url("tiered", prefix, tmp_path)) as kv:
        ns, layers = _store(kv)
        stored = _pttls(prefix)
        client = redis_client()
        try:
            assert client.delete(*_extent_keys(prefix)) == 2  # what maxmemory eviction does
        finally:
            client.close()
        assert _loads_exactly(ns, layers)  # from the directory, then promoted
        blocks = kv._ctx.blocks
        assert isinstance(blocks, TieredBlockStore)
        blocks.wait_for_promotions()
        assert blocks.stats()["tier0"]["promotions"] == 1
        promoted = _pttls(prefix)
        assert len(promoted) == 2
        assert _spread({**stored, **{b"p" + k: v for k, v in promoted.items()}}) < SAME_TTL_MS
        assert _loads_exactly(ns, layers)  # control: served from Redis again


@pytest.mark.parametrize("kind", ["redis", "tiered"])
def test_an_expired_extent_is_not_served_while_redis_still_holds_it(
    tmp_path: Path, prefix: str, kind: str, index: Index
) -> None:
    """Redis keeps an extent longer than its retention (its TTL is the store's): the index
    decides, so the extent is a miss once its retention has run out, and GC deletes its keys."""
    clock = ManualClock(time.time())
    url = _url(kind, prefix, tmp_path)
    with tenantkv.open(tmp_path / "cache", durable=False, block_store_url=url, clock=clock) as kv:
        kv.create_tenant("acme", retention={"agent": "1h"})
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        layers = random_layers(MLA_SMALL, NUM_TOKENS)
        assert ns.store(TOKENS, layers, kind="agent") == NUM_TOKENS
        clock.advance(3599)
        assert ns.lookup(TOKENS) == NUM_TOKENS and _loads_exactly(ns, layers)  # control
        clock.advance(3601)  # past the retention of its last use (the load at 3599 s)
        assert len(_extents(prefix)) == 1  # Redis still holds it ...
        assert ns.lookup(TOKENS) == 0  # ... and the cache does not serve it
        with pytest.raises(tenantkv.CacheMissError):
            ns.load(TOKENS)
        kv.gc()
        assert _extent_keys(prefix) == []  # GC deleted its keys
