"""Named counters (the key epoch) bumped by transactions running side by side.

A key rotation beside a tenant deletion bumps the key epoch in two transactions at once. While
the bump was an update, then an insert where it found no row, two of them bumping a counter
that did not exist yet both inserted it, and the second failed on the duplicate key: one
operator call failed for no reason of its own. The bump is one upsert now.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenantkv.index import counters
from tenantkv.index.database import Database
from tenantkv.index.schema import Base

from .indexes import Index

BUMPERS = 8
#: Each transaction stays open this long after its bump, so that the others bump meanwhile.
HOLD_S = 0.3


@pytest.fixture
def db(tmp_path: Path, index: Index) -> Iterator[Database]:
    database = Database(index.database_url(tmp_path / "counters.db"))
    database.create_tables(Base.metadata)
    try:
        yield database
    finally:
        database.close()


def test_transactions_bumping_a_new_counter_together_all_succeed(db: Database) -> None:
    """On PostgreSQL the transactions overlap (all bump before the first commits); SQLite runs
    write transactions one at a time, so there it checks the upsert's arithmetic only."""
    ready = threading.Barrier(BUMPERS)
    errors: list[BaseException] = []

    def bump() -> None:
        try:
            ready.wait(timeout=30)
            with db.write() as session:
                counters.bump(session, "fresh")
                time.sleep(HOLD_S)
        except BaseException as err:  # judged below
            errors.append(err)

    threads = [threading.Thread(target=bump) for _ in range(BUMPERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a bump still waits after 60 s"
    assert not errors, [repr(err) for err in errors]
    with db.read() as session:
        assert counters.read(session, "fresh") == BUMPERS
        assert counters.read(session, "other") == 0  # control: a counter nobody bumped


def test_a_counter_bumped_one_after_another_counts_every_bump(db: Database) -> None:
    for expected in range(1, 4):
        with db.write() as session:
            counters.bump(session, counters.KEY_EPOCH)
        with db.read() as session:
            assert counters.read(session, counters.KEY_EPOCH) == expected
