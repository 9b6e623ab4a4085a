"""Named counters shared by every node (the key epoch)."""

from __future__ import annotations

from sqlalchemy import Connection, select, update
from sqlalchemy.orm import Session

from .schema import Counter

KEY_EPOCH = "key_epoch"


def bump(session: Session, name: str) -> None:
    """Add one to counter ``name`` (created at 1), in the caller's transaction."""
    changed = session.execute(
        update(Counter).where(Counter.name == name).values(value=Counter.value + 1)
    )
    if not getattr(changed, "rowcount", 0):
        session.add(Counter(name=name, value=1))
        session.flush()


def read(executor: Connection | Session, name: str) -> int:
    return int(executor.execute(select(Counter.value).where(Counter.name == name)).scalar() or 0)
