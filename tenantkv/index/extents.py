"""Extent and block rows: the one way they leave the index.

Every path that removes extents (eviction, GC, purge, re-sealing, a damaged or lost extent,
tenant deletion) deletes their rows here, inside the caller's write transaction, and removes
their bytes only after that transaction commits (``tenantkv.extent_removal``). A crash in
between leaves an unindexed file for the orphan sweep, never a row pointing at missing bytes.
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from .schema import Block, Extent

# SQLite allows 32,766 bound parameters; stay far below it and below PostgreSQL's limits.
CHUNK = 500


def delete_rows(session: Session, extent_ids: Collection[str]) -> None:
    """Delete the extents' block rows and extent rows (in the caller's transaction)."""
    ids = list(extent_ids)
    for start in range(0, len(ids), CHUNK):
        batch = ids[start : start + CHUNK]
        session.execute(delete(Block).where(Block.extent_id.in_(batch)))
        session.execute(delete(Extent).where(Extent.id.in_(batch)))


def indexed(session: Session, extent_ids: Collection[str]) -> set[str]:
    """Which of ``extent_ids`` still have an extent row."""
    ids = list(extent_ids)
    found: set[str] = set()
    for start in range(0, len(ids), CHUNK):
        batch = ids[start : start + CHUNK]
        found.update(session.scalars(select(Extent.id).where(Extent.id.in_(batch))).all())
    return found
