"""Named counters shared by every node (the key epoch)."""

from __future__ import annotations

from sqlalchemy import Connection, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from .schema import Counter

KEY_EPOCH = "key_epoch"


def bump(session: Session, name: str) -> None:
    """Add one to counter ``name`` (created at 1), in the caller's transaction.

    One upsert: an update, then an insert where it found no row, let two transactions that
    bump a new counter together (a key rotation beside a deletion) both insert it, and the
    second failed on the duplicate key."""
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    session.execute(
        insert(Counter)
        .values(name=name, value=1)
        .on_conflict_do_update(index_elements=[Counter.name], set_={"value": Counter.value + 1})
    )


def read(executor: Connection | Session, name: str) -> int:
    return int(executor.execute(select(Counter.value).where(Counter.name == name)).scalar() or 0)
