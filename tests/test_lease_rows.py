"""A lease's row (what other nodes honour) is written once the lease is ``LEASE_WRITE_DELAY_S``
old: loads that end sooner, an engine's hits one step apart, write no row and delete none."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select

import tenantkv
from tenantkv.components import coordination
from tenantkv.components.coordination import LEASE_WRITE_DELAY_S, LeaseKeeper
from tenantkv.index import leases
from tenantkv.index.schema import Lease
from tests.helpers import MLA_SMALL, ManualClock, last_used, random_layers, random_tokens


def _stored_extent(kv: tenantkv.TenantKV) -> tuple[str, list[int]]:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    tokens = random_tokens(64, seed=11)
    ns.store(tokens, random_layers(MLA_SMALL, 64, seed=11))
    (extent,) = last_used(kv)  # the one extent's id
    return extent, tokens


def _lease_rows(kv: tenantkv.TenantKV) -> set[bytes]:
    with kv.context.index.read() as session:
        return set(session.scalars(select(Lease.lease_id)).all())


def test_a_lease_gets_its_row_once_it_is_old_enough(kv: tenantkv.TenantKV) -> None:
    extent, _ = _stored_extent(kv)
    clock = ManualClock()
    started = clock.now
    keeper = LeaseKeeper(kv.context.index, kv.context.remover, node_id="test-node", clock=clock)
    assert keeper.next_due(LEASE_WRITE_DELAY_S) is None
    older = keeper.take([extent])
    clock.advance(0.6 * LEASE_WRITE_DELAY_S)
    younger = keeper.take([extent])
    assert keeper.next_due(LEASE_WRITE_DELAY_S) == pytest.approx(started + LEASE_WRITE_DELAY_S)
    clock.advance(0.6 * LEASE_WRITE_DELAY_S)  # older: 1.2 delays old; younger: 0.6
    assert keeper.persist_pending(LEASE_WRITE_DELAY_S)
    assert _lease_rows(kv) == {older}  # the younger lease waits for its age
    # A lease that ends before its age needs no row, and its release writes none.
    keeper.release(younger)
    assert keeper.next_due(LEASE_WRITE_DELAY_S) is None
    assert _lease_rows(kv) == {older}
    # Control: a young lease still running gets its row once it is old enough.
    third = keeper.take([extent])
    assert keeper.persist_pending(LEASE_WRITE_DELAY_S) and _lease_rows(kv) == {older}
    clock.advance(LEASE_WRITE_DELAY_S)
    assert keeper.persist_pending(LEASE_WRITE_DELAY_S)
    assert _lease_rows(kv) == {older, third}
    keeper.release(older)
    keeper.release(third)
    assert _lease_rows(kv) == set()


@pytest.mark.usefixtures("index")
def test_loads_shorter_than_the_delay_write_no_lease_rows_one_step_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loads as an engine's hits run them (each a few ms, the next a step later) with the
    coordination thread running: no lease row is written (nor then deleted); a load that runs
    longer than the delay gets its row."""
    written: list[int] = []
    acquire = leases.acquire

    def counted(*args: object, **kwargs: object) -> None:
        written.append(1)
        acquire(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(leases, "acquire", counted)
    with tenantkv.open(tmp_path / "cache", durable=False) as kv:
        _, tokens = _stored_extent(kv)
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        # Each load open for half the delay, the next one a moment after: whenever a lease
        # turns the delay old, another is running (the lease of an engine's next hit).
        for _ in range(12):
            started = time.monotonic()
            with ns.load(tokens) as stream:
                for _layer in stream:
                    pass
                time.sleep(max(0.0, started + LEASE_WRITE_DELAY_S / 2 - time.monotonic()))
            if time.monotonic() - started >= 0.9 * LEASE_WRITE_DELAY_S:
                pytest.skip("a load took about the delay on this host")
            time.sleep(LEASE_WRITE_DELAY_S / 20)
        time.sleep(2 * LEASE_WRITE_DELAY_S)  # any row due by now has been written
        assert written == []
        # Control: a load held open past the delay gets its row, which other nodes see.
        stream = ns.load(tokens)
        try:
            deadline = time.monotonic() + 10
            while not _lease_rows(kv) and time.monotonic() < deadline:
                time.sleep(LEASE_WRITE_DELAY_S)
            assert len(written) == 1 and len(_lease_rows(kv)) == 1
        finally:
            stream.close()
        assert _lease_rows(kv) == set()


def test_a_failed_row_write_waits_for_the_next_round(
    kv: tenantkv.TenantKV, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the index refuses lease rows the thread does not retry in a loop: one attempt,
    then the next round (or the next lease taken) tries again."""
    extent, _ = _stored_extent(kv)
    keeper = LeaseKeeper(kv.context.index, kv.context.remover, node_id="test-node")
    attempts: list[int] = []
    acquire = leases.acquire

    def refuse(*args: object, **kwargs: object) -> None:
        from sqlalchemy.exc import OperationalError

        attempts.append(1)
        raise OperationalError("INSERT", {}, Exception("index down"))

    monkeypatch.setattr(leases, "acquire", refuse)
    thread = coordination.CoordinationThread(keeper, kv.context.key_epoch, interval=60)
    thread.start()
    try:
        lease = keeper.take([extent])
        deadline = time.monotonic() + 10
        while not attempts and time.monotonic() < deadline:  # a busy host may be late
            time.sleep(LEASE_WRITE_DELAY_S)
        time.sleep(6 * LEASE_WRITE_DELAY_S)  # time for a retry loop to show itself
        assert attempts == [1]
        assert keeper.next_due(LEASE_WRITE_DELAY_S) is not None  # still waits for its row
        # Control: once the index takes rows again, the next lease taken brings both rows.
        monkeypatch.setattr(leases, "acquire", acquire)
        second = keeper.take([extent])
        deadline = time.monotonic() + 10
        while _lease_rows(kv) != {lease, second} and time.monotonic() < deadline:
            time.sleep(LEASE_WRITE_DELAY_S)
        assert _lease_rows(kv) == {lease, second}
    finally:
        thread.stop()
        keeper.release_all()
    assert _lease_rows(kv) == set()


def test_a_release_does_not_wait_for_its_row_being_written(
    kv: tenantkv.TenantKV, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease released while the coordination thread writes its row (the index stalling)
    returns at once; the writer deletes the row once written, so none is left behind."""
    extent, _ = _stored_extent(kv)
    clock = ManualClock()
    keeper = LeaseKeeper(kv.context.index, kv.context.remover, node_id="test-node", clock=clock)
    writing, go_on = threading.Event(), threading.Event()
    acquire, release = leases.acquire, leases.release
    deleted: list[bytes] = []

    def stalled(*args: object, **kwargs: object) -> None:
        writing.set()
        assert go_on.wait(10)
        acquire(*args, **kwargs)  # type: ignore[arg-type]

    def counted(connection: object, lease_id: bytes) -> None:
        deleted.append(lease_id)
        release(connection, lease_id)  # type: ignore[arg-type]

    monkeypatch.setattr(leases, "acquire", stalled)
    monkeypatch.setattr(leases, "release", counted)
    lease = keeper.take([extent])
    clock.advance(LEASE_WRITE_DELAY_S)
    written: list[bool] = []
    writer = threading.Thread(target=lambda: written.append(keeper.persist_pending(0.0)))
    writer.start()
    try:
        assert writing.wait(10)
        started = time.monotonic()
        keeper.release(lease)  # while its row is being written
        assert time.monotonic() - started < 1.0, "the release waited for the row's write"
        assert deleted == [] and keeper.active() == {}
    finally:
        go_on.set()
        writer.join(10)
    assert written == [True]
    assert deleted == [lease] and _lease_rows(kv) == set()  # the writer deleted it
    # Control: a lease released after its row was written deletes the row itself.
    second = keeper.take([extent])
    clock.advance(LEASE_WRITE_DELAY_S)
    assert keeper.persist_pending(LEASE_WRITE_DELAY_S) and _lease_rows(kv) == {second}
    keeper.release(second)
    assert deleted == [lease, second] and _lease_rows(kv) == set()


class _Watcher:
    """Counts the key-epoch checks the coordination thread makes (its rounds)."""

    def __init__(self) -> None:
        self.checks = 0

    def check(self) -> bool:
        self.checks += 1
        return False


def test_a_stream_of_loads_does_not_hold_off_the_rounds(kv: tenantkv.TenantKV) -> None:
    """Renewals and the key-epoch check run every round even while some lease always waits
    for its row (an engine serving without a pause)."""
    extent, _ = _stored_extent(kv)
    keeper = LeaseKeeper(kv.context.index, kv.context.remover, node_id="test-node")
    watcher = _Watcher()
    interval = 4 * LEASE_WRITE_DELAY_S
    thread = coordination.CoordinationThread(keeper, watcher, interval=interval)  # type: ignore[arg-type]
    stop = time.monotonic() + 12 * interval
    thread.start()
    try:
        # A lease always running and waiting for its row: each next one taken before the
        # last is released, each shorter than the delay.
        lease = keeper.take([extent])
        while time.monotonic() < stop:
            time.sleep(LEASE_WRITE_DELAY_S / 4)
            lease, last = keeper.take([extent]), lease
            keeper.release(last)
        keeper.release(lease)
    finally:
        thread.stop()
        keeper.release_all()
    # 12 intervals: at least a few rounds, whatever the host's scheduling.
    assert watcher.checks >= 3
    assert _lease_rows(kv) == set()
