"""Settings of the index itself, one row each (the master-key check, GC marks)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from .schema import SchemaInfo

MASTER_KEY_CHECK = "master_key_check"
USAGE_SUMMARY_MARK = "usage_summary_until"


def get(session: Session, name: str) -> str | None:
    row = session.get(SchemaInfo, name)
    return None if row is None else row.value


def put(session: Session, name: str, value: str) -> None:
    session.merge(SchemaInfo(name=name, value=value))
