"""PostgreSQL going away under a running node, and coming back (issue 14, "Outages").

What a node must do: lookups miss and stores are skipped (a log line, a ``degraded_<op>`` health
counter), a load already running finishes byte-exact or fails with a typed error, and the node
recovers by itself once the server is back, without a restart. The shared server itself is never
stopped: one node's backends are killed (``pg_terminate_backend``, found by the node's
``application_name``), or the node reaches the server through a proxy the test stops and starts.
A second node connected directly is the control: it is untouched throughout.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, make_url, select, text

import tenantkv
from tenantkv.errors import CacheMissError, CacheUnavailableError
from tenantkv.index.schema import Lease

from .helpers import MLA_SMALL, layers_equal, random_layers, random_tokens
from .indexes import POSTGRES_URL, Index
from .tcp_proxy import TcpProxy

TOKENS = 128
_BACKENDS = text("SELECT pid FROM pg_stat_activity WHERE application_name = :name")
_PREPARED = text("SELECT count(*) FROM pg_prepared_statements")
_TERMINATE = text(
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = :name"
)


@pytest.fixture
def admin(index: Index) -> Iterator[Engine]:
    """A connection to the server outside every cache (PostgreSQL only)."""
    if index.is_sqlite:
        pytest.skip("a PostgreSQL outage: SQLite has no server to lose")
    engine = create_engine(POSTGRES_URL, pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


def _backends(admin: Engine, kv: tenantkv.TenantKV) -> set[int]:
    with admin.connect() as connection:
        return set(
            connection.execute(_BACKENDS, {"name": kv.context.index.application_name}).scalars()
        )


def _wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Poll ``predicate`` until it holds; the timeout only bounds a failure, so it is generous
    enough for a loaded CI machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _lease_expiry(kv: tenantkv.TenantKV) -> float:
    with kv.context.index.read() as session:
        return max(session.scalars(select(Lease.expires_at)).all(), default=0.0)


def test_killing_one_nodes_backends_spares_the_others_and_it_reconnects(
    tmp_path: Path, admin: Engine
) -> None:
    root = tmp_path / "cache"
    tokens = random_tokens(TOKENS, seed=1)
    expected = random_layers(MLA_SMALL, TOKENS, seed=1)
    with (
        tenantkv.open(root, durable=False) as node_a,
        tenantkv.open(root, durable=False) as node_b,
    ):
        node_a.create_tenant("acme", quota_bytes=2**30)
        ns_a = node_a.namespace("acme", model="fleet-model", layout=MLA_SMALL)
        ns_b = node_b.namespace("acme", model="fleet-model", layout=MLA_SMALL)
        assert ns_a.store(tokens, expected) == TOKENS
        assert ns_b.lookup(tokens) == TOKENS
        names = {node_a.context.index.application_name, node_b.context.index.application_name}
        assert len(names) == 2 and all(name and name.startswith("tenantkv:") for name in names)
        backends_b = _backends(admin, node_b)
        assert _backends(admin, node_a) and backends_b

        with ns_a.load(tokens) as stream:
            first = stream.wait_for_layer(0)
            doomed = _backends(admin, node_a)
            with admin.connect() as connection:
                killed = connection.execute(
                    _TERMINATE, {"name": node_a.context.index.application_name}
                ).scalar_one()
            assert doomed and killed >= 1
            # Every backend node A had is gone (its coordination thread may already have opened
            # a new one for a lease write: reconnecting is what a node should do).
            assert _wait_for(lambda: not doomed & _backends(admin, node_a))
            # the running load reads the extent's files: it finishes byte-exact
            rest = [stream.wait_for_layer(i) for i in range(1, MLA_SMALL.num_layers)]
        assert all(map(layers_equal, [first, *rest], expected))

        # Node A reconnects on its next operation (the pool tests connections before use) ...
        assert ns_a.lookup(tokens) == TOKENS
        other = random_tokens(TOKENS, seed=2)
        assert ns_a.store(other, random_layers(MLA_SMALL, TOKENS, seed=2)) == TOKENS
        assert node_a.health_counters().get("degraded_lookup") is None
        # ... and node B kept its connections and sees A's new entry.
        assert backends_b <= _backends(admin, node_b)
        assert ns_b.lookup(other) == TOKENS
        assert node_a.security_events() == {} and node_b.security_events() == {}


def test_an_unreachable_server_degrades_to_misses_and_the_node_recovers(
    tmp_path: Path, index: Index, admin: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tenantkv")
    root = tmp_path / "cache"
    server = make_url(POSTGRES_URL)
    proxy = TcpProxy((server.host or "127.0.0.1", server.port or 5432))
    proxy.start()
    proxied = make_url(index.url(root)).set(host="127.0.0.1", port=proxy.port)
    hot, blocked, later = (random_tokens(TOKENS, seed=s) for s in (3, 4, 5))
    hot_kv = random_layers(MLA_SMALL, TOKENS, seed=3)
    try:
        with (
            tenantkv.open(root, durable=False) as node_b,
            tenantkv.open(
                root,
                durable=False,
                database_url=proxied.render_as_string(hide_password=False),
                lease_seconds=0.6,
            ) as node_a,
        ):
            node_b.create_tenant("acme", quota_bytes=2**30)
            ns_b = node_b.namespace("acme", model="fleet-model", layout=MLA_SMALL)
            assert ns_b.store(hot, hot_kv) == TOKENS
            ns_a = node_a.namespace("acme", model="fleet-model", layout=MLA_SMALL)
            assert ns_a.lookup(hot) == TOKENS  # control: through the proxy, a hit

            finishing = ns_a.load(hot)  # runs to its end during the outage
            held = ns_a.load(hot)  # stays open across the outage: its lease must be renewed
            held.wait_for_layer(0)
            assert _wait_for(lambda: bool(node_b.leased_extents()))

            proxy.stop()
            # lookups miss, stores are skipped, a new load is a typed miss: logged and counted
            assert ns_a.lookup(hot) == 0
            assert ns_a.store(blocked, random_layers(MLA_SMALL, TOKENS, seed=4)) == 0
            with pytest.raises(CacheMissError):
                ns_a.load(hot)
            counts = node_a.health_counters()
            assert counts["degraded_lookup"] >= 1 and counts["degraded_store"] >= 1
            assert counts["degraded_load"] >= 1
            messages = [record.getMessage() for record in caplog.records]
            assert any("lookup degraded to a miss" in m for m in messages)
            # the load that was running delivers every layer byte-exact
            layers = [finishing.wait_for_layer(i) for i in range(MLA_SMALL.num_layers)]
            assert all(map(layers_equal, layers, hot_kv))
            finishing.close()
            # the coordination thread meets the outage, and A's lease lapses meanwhile
            assert _wait_for(lambda: any("lease writes" in r.getMessage() for r in caplog.records))
            assert _wait_for(lambda: not node_b.leased_extents())
            assert ns_b.lookup(hot) == TOKENS and ns_b.lookup(blocked) == 0  # B unaffected

            proxy.start()
            # A recovers on its own: hits, stores for real, and renews its running lease again
            assert ns_a.lookup(hot) == TOKENS
            assert ns_a.store(later, random_layers(MLA_SMALL, TOKENS, seed=5)) == TOKENS
            assert ns_b.lookup(later) == TOKENS
            lapsed_at = _lease_expiry(node_b)
            assert _wait_for(lambda: _lease_expiry(node_b) > lapsed_at)
            assert node_b.leased_extents()
            rest = [held.wait_for_layer(i) for i in range(1, MLA_SMALL.num_layers)]
            assert all(map(layers_equal, rest, hot_kv[1:]))
            held.close()
            assert node_a.security_events() == {} and node_b.security_events() == {}
    finally:
        proxy.stop()


def _silent_server() -> socket.socket:
    """A port that accepts connections (the kernel completes them) but never answers."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener


@pytest.mark.parametrize("url_timeout", [None, 1])
def test_a_server_that_never_answers_fails_open_within_the_connect_timeout(
    tmp_path: Path, url_timeout: int | None
) -> None:
    """A node whose index server hangs gives up after ``connect_timeout`` (5 s unless the URL
    says otherwise) with a typed error, instead of waiting for the kernel's TCP timeout."""
    listener = _silent_server()
    query = "" if url_timeout is None else f"?connect_timeout={url_timeout}"
    url = f"postgresql+psycopg://postgres@127.0.0.1:{listener.getsockname()[1]}/test{query}"
    outcome: list[BaseException | None] = []

    def attempt() -> None:
        try:
            tenantkv.open(tmp_path / "cache", durable=False, database_url=url).close()
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    started = time.monotonic()
    opener = threading.Thread(target=attempt, daemon=True)
    opener.start()
    opener.join(timeout=60)  # without a connect timeout libpq would wait for minutes
    elapsed = time.monotonic() - started
    listener.close()
    assert outcome, "open() was still waiting for the silent server after 60 s"
    assert isinstance(outcome[0], CacheUnavailableError), outcome
    assert "timeout" in str(outcome[0])
    expected = 5 if url_timeout is None else url_timeout
    # libpq gives up once the timeout expires for each address it tries
    assert expected * 0.8 <= elapsed < expected * 2 + 5


def test_a_cache_never_leaves_prepared_statements_on_the_server(
    tmp_path: Path, index: Index, admin: Engine
) -> None:
    """psycopg would prepare a statement on its fifth run; a lookup's long IN list then runs on a
    generic plan, several times slower, and a PgBouncer in transaction mode breaks. The cache's
    connections never prepare (control: a plain psycopg connection does, and the view shows it)."""
    root = tmp_path / "cache"
    tokens = random_tokens(TOKENS, seed=6)
    with tenantkv.open(root, durable=False) as kv:
        kv.create_tenant("acme", quota_bytes=2**30)
        ns = kv.namespace("acme", model="fleet-model", layout=MLA_SMALL)
        assert ns.store(tokens, random_layers(MLA_SMALL, TOKENS, seed=6)) == TOKENS
        for _ in range(10):
            assert ns.lookup(tokens) == TOKENS
        with kv.context.index.engine.connect() as connection:
            assert connection.execute(_PREPARED).scalar_one() == 0
    control = create_engine(POSTGRES_URL, pool_size=1, max_overflow=0)
    try:
        with control.connect() as connection:
            for _ in range(6):
                connection.execute(text("SELECT 1 WHERE 1 = :one"), {"one": 1})
            assert connection.execute(_PREPARED).scalar_one() >= 1
    finally:
        control.dispose()
