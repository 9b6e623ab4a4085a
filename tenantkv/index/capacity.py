"""The store's capacity and overcommit policy: index state every node reads in the same
transaction as the quota change it checks, never a value one process keeps."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from .schema import SchemaInfo

_CAPACITY = "capacity_bytes"
_OVERCOMMIT = "allow_overcommit"


@dataclass(frozen=True)
class Capacity:
    capacity_bytes: int
    allow_overcommit: bool


def read(session: Session, *, lock: bool = False) -> Capacity | None:
    """The stored capacity, or None before the index was first opened.

    With ``lock`` the capacity row is locked for the transaction: every quota or capacity
    change takes it, so on PostgreSQL two of them cannot each miss the other's reservation and
    together overcommit the store (SQLite runs write transactions one at a time anyway)."""
    capacity = session.get(SchemaInfo, _CAPACITY, with_for_update=lock)
    if capacity is None:
        return None
    overcommit = session.get(SchemaInfo, _OVERCOMMIT)
    return Capacity(int(capacity.value), overcommit is not None and overcommit.value == "1")


def write(session: Session, value: Capacity) -> None:
    session.merge(SchemaInfo(name=_CAPACITY, value=str(value.capacity_bytes)))
    session.merge(SchemaInfo(name=_OVERCOMMIT, value="1" if value.allow_overcommit else "0"))
