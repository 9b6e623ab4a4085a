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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tenantkv
from tenantkv import TenantKV
from tenantkv.storage import BlockStoreUrlError, TieredBlockStore, open_block_store
from tests.block_stores import drop_prefix, new_prefix, redis_client, redis_keys, redis_url
from tests.indexes import Index

from .helpers import MLA_SMALL, load_all, random_layers
from .test_at_rest import TOKENS, bytes_of, canary_layers, canary_needles, token_needles

pytest.importorskip("redis")
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
            assert all(client.ttl(k) > 0 for k in keys)  # ... and expires with its retention
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
                with pytest.raises(tenantkv.LoadError, match="reading a cached extent failed"):
                    ns.load(TOKENS)  # the typed I/O failure, before any layer; bytes kept
            assert kv.health_counters().get("degraded_store", 0) == 1
            assert any("store" in r.getMessage() for r in caplog.records)
            assert kv.security_events() == {}
            gate.open = True
            assert ns.lookup(TOKENS) == NUM_TOKENS  # the index kept it: the bytes were fine
            assert _loads_exactly(ns, layers)  # recovered by itself
            assert ns.store([t + 1 for t in TOKENS], other) == NUM_TOKENS
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


def test_a_longer_retention_reaches_the_redis_ttls_at_once(
    tmp_path: Path, prefix: str, index: Index
) -> None:
    """Redis forgets an extent when its TTL (set from the retention at its last store or load)
    runs out. Lengthening the retention must push the TTLs out then, not at the next use, or
    Redis drops extents the index still serves. Other classes' extents keep their TTLs."""
    with _open(tmp_path / "cache", redis_url(prefix)) as kv:
        kv.create_tenant("acme", retention={"agent": "1h", "chat": "2h"})
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        layers = random_layers(MLA_SMALL, NUM_TOKENS)
        assert ns.store(TOKENS, layers, kind="agent") == NUM_TOKENS
        other = [t + 1 for t in TOKENS]
        assert ns.store(other, layers, kind="chat") == NUM_TOKENS
        # (no load before the TTLs are read: a load restarts its extent's TTL in the background)
        client = redis_client()
        try:
            before = {k: client.ttl(k) for k in _extent_keys(prefix)}
            assert len(_extents(prefix)) == 2
            agent = {k for k, ttl in before.items() if ttl <= 3600}
            chat = set(before) - agent
            assert agent and chat and all(3000 < ttl <= 7200 for ttl in before.values())
            kv.update_tenant("acme", retention={"agent": "30d"})
            after = {k: client.ttl(k) for k in before}
        finally:
            client.close()
        assert all(after[k] > 29 * 86400 for k in agent)  # pushed out with the retention
        assert all(abs(after[k] - before[k]) <= 5 for k in chat)  # untouched
        assert ns.lookup(TOKENS) == NUM_TOKENS and _loads_exactly(ns, layers)  # still served
