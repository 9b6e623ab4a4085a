"""Records of use of one tenant written side by side (two nodes loading the same extents).

Each batch's transaction ran one UPDATE per time of use, so two batches holding the same extents
at different times locked them in different orders, and PostgreSQL aborted one of them with a
deadlock: that batch's use was lost (retention not restarted, LRU not updated). Now
``record_use`` locks a batch's extent rows in id order first. The interleaving that deadlocked
is forced here, not hoped for: the second batch starts right after the first one's first UPDATE,
and the first one waits before its next statement.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, event, select

from tenantkv.index.database import Database
from tenantkv.index.plan import record_use
from tenantkv.index.schema import Base, Extent, Namespace, Tenant

from .indexes import Index

CREATED = 1_000_000.0
EARLIER = CREATED + 10.0  # "t1"
LATER = CREATED + 20.0  # "t2"
CHAT_TTL = 7 * 86400.0
#: How long the first batch waits after its first UPDATE, the second one running meanwhile.
HOLD_S = 0.5
TIMEOUT_S = 30.0


@pytest.fixture
def db(tmp_path: Path, index: Index) -> Iterator[Database]:
    database = Database(index.database_url(tmp_path / "use_locks.db"))
    database.create_tables(Base.metadata)
    try:
        yield database
    finally:
        database.close()


def _tenant_with_extents(db: Database) -> tuple[bytes, str, str]:
    """A tenant (one retention class, ``chat``) with a namespace and two extents stored at
    ``CREATED``: its id and the extents' ids, A before B in id order."""
    tenant_id, namespace_id = secrets.token_bytes(16), secrets.token_bytes(16)
    first, second = sorted(secrets.token_hex(16) for _ in range(2))
    with db.write() as session:
        session.add(
            Tenant(
                id=tenant_id,
                name=f"t-{tenant_id.hex()}",
                created_at=CREATED,
                updated_at=CREATED,
                current_key_version=1,
                quota_bytes=2**30,
                retention=json.dumps({"chat": CHAT_TTL}),
            )
        )
        session.flush()
        session.add(
            Namespace(
                id=namespace_id,
                tenant_id=tenant_id,
                scope="",
                model="m",
                fingerprint="f" * 64,
                wrapped_hash_key=b"\0" * 32,
                created_at=CREATED,
            )
        )
        session.flush()
        for extent_id in (first, second):
            session.add(
                Extent(
                    id=extent_id,
                    namespace_id=namespace_id,
                    tenant_id=tenant_id,
                    key_version=1,
                    kind="chat",
                    suite=1,
                    salt=b"\0" * 16,
                    num_blocks=1,
                    num_layers=1,
                    segment_bytes=64,
                    size_bytes=64,
                    created_at=CREATED,
                    last_used_at=CREATED,
                    expires_at=CREATED + CHAT_TTL,
                )
            )
    return tenant_id, first, second


def _uses(db: Database, extent_ids: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """``extent id -> (last_used_at, expires_at)`` as the index has them."""
    with db.read() as session:
        rows = session.execute(
            select(Extent.id, Extent.last_used_at, Extent.expires_at).where(
                Extent.id.in_(extent_ids)
            )
        )
        return {extent_id: (used, expires) for extent_id, used, expires in rows}


def test_batches_using_the_same_extents_at_different_times_both_land(
    db: Database, index: Index
) -> None:
    if index.is_sqlite:
        pytest.skip("row locks taken in different orders: SQLite runs one writer at a time")
    tenant_id, a, b = _tenant_with_extents(db)
    assert _uses(db, (a, b)) == {a: (CREATED, CREATED + CHAT_TTL), b: (CREATED, CREATED + CHAT_TTL)}
    second_may_start = threading.Event()
    errors: dict[str, BaseException] = {}

    def hold_after_first_update(
        connection: Connection, _cursor: Any, statement: str, *_args: Any
    ) -> None:
        if statement.lstrip().upper().startswith("UPDATE") and not second_may_start.is_set():
            second_may_start.set()
            time.sleep(HOLD_S)  # before this batch's next statement: the other one runs now

    def first_batch() -> None:  # "T2": B at the earlier time, A at the later one
        try:
            with db.write_connection() as connection:
                event.listen(connection, "after_cursor_execute", hold_after_first_update)
                record_use(connection, tenant_id, {EARLIER: [b], LATER: [a]})
        except BaseException as err:  # judged below
            errors["first"] = err

    def second_batch() -> None:  # "T1": A at the earlier time, B at the later one
        try:
            if not second_may_start.wait(TIMEOUT_S):
                raise TimeoutError("the first batch never ran an UPDATE")
            with db.write_connection() as connection:
                record_use(connection, tenant_id, {EARLIER: [a], LATER: [b]})
        except BaseException as err:  # judged below
            errors["second"] = err

    threads = [threading.Thread(target=first_batch), threading.Thread(target=second_batch)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=2 * TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a batch still runs after 60 s"
    assert second_may_start.is_set()  # the interleaving was forced: the hold did run
    assert not errors, {name: repr(err) for name, err in errors.items()}
    # Both batches' uses landed, each extent at its latest use (an earlier record committed
    # later does not move it back); and they changed: CREATED was there before.
    assert _uses(db, (a, b)) == {a: (LATER, LATER + CHAT_TTL), b: (LATER, LATER + CHAT_TTL)}


def test_an_earlier_use_recorded_later_does_not_move_an_extent_back(db: Database) -> None:
    tenant_id, a, b = _tenant_with_extents(db)
    with db.write_connection() as connection:
        assert record_use(connection, tenant_id, {LATER: [a]}) == {"chat": CHAT_TTL}
    with db.write_connection() as connection:
        record_use(connection, tenant_id, {EARLIER: [a, b]})
    assert _uses(db, (a, b)) == {
        a: (LATER, LATER + CHAT_TTL),  # kept: the record of EARLIER came after
        b: (EARLIER, EARLIER + CHAT_TTL),  # control: an extent used then does move
    }
