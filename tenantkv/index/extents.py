"""Extent and block rows: the one way they leave the index.

Every path that removes extents (eviction, GC, purge, re-sealing, a damaged or lost extent,
tenant deletion) deletes their rows here, inside the caller's write transaction, and removes
their bytes only after that transaction commits (``tenantkv.components.extent_removal``). A crash in
between leaves an unindexed file for the orphan sweep, never a row pointing at missing bytes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BindParameter,
    Case,
    Connection,
    Float,
    bindparam,
    case,
    delete,
    select,
    update,
)
from sqlalchemy.orm import Session

from . import removals
from .schema import Block, Extent, Namespace

# SQLite allows 32,766 bound parameters; stay far below it and below PostgreSQL's limits.
CHUNK = 500


def delete_rows(session: Session, extent_ids: Collection[str]) -> None:
    """Delete the extents' block rows and extent rows (in the caller's transaction), and count
    a removal in each of their namespaces (``index.removals``: every node's lookup structure
    then stops trusting what it holds of them)."""
    ids = list(extent_ids)
    for start in range(0, len(ids), CHUNK):
        batch = ids[start : start + CHUNK]
        namespace_ids = session.scalars(
            select(Extent.namespace_id).where(Extent.id.in_(batch)).distinct()
        ).all()
        removals.bump(session, namespace_ids)
        session.execute(delete(Block).where(Block.extent_id.in_(batch)))
        session.execute(delete(Extent).where(Extent.id.in_(batch)))


def retention_by_class(count: int) -> tuple[list[BindParameter[str]], Case[Any]]:
    """The class names ``kind_0 .. kind_{count-1}`` as bound parameters and ``CASE kind WHEN
    :kind_i THEN :ttl_i END``: the retention of each extent's class, so that one statement
    restarts the retention of extents of every class (a statement per class made a tenant's
    bookkeeping grow with the classes it chose). Bind the values with
    :func:`retention_parameters`."""
    kinds = [bindparam(f"kind_{i}", type_=Extent.kind.type) for i in range(count)]
    ttls = [bindparam(f"ttl_{i}", type_=Float()) for i in range(count)]
    return kinds, case(*zip(kinds, ttls, strict=True), value=Extent.kind)


def retention_parameters(classes: Mapping[str, float]) -> dict[str, Any]:
    """The values of :func:`retention_by_class` for ``classes`` (class -> seconds)."""
    values: dict[str, Any] = {}
    for i, (kind, ttl) in enumerate(sorted(classes.items())):
        values[f"kind_{i}"] = kind
        values[f"ttl_{i}"] = ttl
    return values


def tenant_of(session: Session, extent_id: str) -> bytes | None:
    return session.scalar(select(Extent.tenant_id).where(Extent.id == extent_id))


def indexed(executor: Session | Connection, extent_ids: Collection[str]) -> set[str]:
    """Which of ``extent_ids`` still have an extent row."""
    ids = list(extent_ids)
    found: set[str] = set()
    for start in range(0, len(ids), CHUNK):
        batch = ids[start : start + CHUNK]
        rows = executor.execute(select(Extent.id).where(Extent.id.in_(batch))).scalars()
        found.update(str(row) for row in rows)
    return found


def sealed_before(session: Session, tenant_id: bytes, version: int) -> list[Extent]:
    """The tenant's extents sealed with a data-key version older than ``version``."""
    return list(
        session.scalars(
            select(Extent).where(Extent.tenant_id == tenant_id, Extent.key_version < version)
        ).all()
    )


def referenced_slots(session: Session, extent_id: str) -> list[tuple[bytes, int]]:
    """(block key, slot) of every block that points into the extent, by slot."""
    rows = session.execute(
        select(Block.block_key, Block.slot).where(Block.extent_id == extent_id).order_by(Block.slot)
    ).all()
    return [(bytes(key), int(slot)) for key, slot in rows]


def switch_over(session: Session, old: Extent, new: Extent, block_keys: Sequence[bytes]) -> None:
    """Point the blocks ``block_keys`` (slot by slot) at ``new`` and drop ``old``'s rows, in
    the caller's transaction (re-sealing)."""
    session.add(new)
    session.flush()
    for new_slot, block_key in enumerate(block_keys):
        session.execute(
            update(Block)
            .where(Block.namespace_id == old.namespace_id, Block.block_key == block_key)
            .values(extent_id=new.id, slot=new_slot)
        )
    delete_rows(session, [old.id])


@dataclass(frozen=True)
class ExtentSize:
    id: str
    tenant_id: bytes
    size_bytes: int
    scope: str


def expired(session: Session, now: float) -> list[ExtentSize]:
    """Extents whose retention ran out by ``now``, oldest expiry first."""
    rows = session.execute(
        select(Extent.id, Extent.tenant_id, Extent.size_bytes, Namespace.scope)
        .join(Namespace, Namespace.id == Extent.namespace_id)
        .where(Extent.expires_at <= now)
        .order_by(Extent.expires_at)
    ).all()
    return [ExtentSize(row.id, row.tenant_id, int(row.size_bytes), row.scope) for row in rows]


def of_tenant(session: Session, tenant_id: bytes, scope: str | None) -> list[ExtentSize]:
    """The tenant's extents (of ``scope`` only, if given; ``""`` is the tenant-wide scope)."""
    query = (
        select(Extent.id, Extent.tenant_id, Extent.size_bytes, Namespace.scope)
        .join(Namespace, Namespace.id == Extent.namespace_id)
        .where(Extent.tenant_id == tenant_id)
    )
    if scope is not None:
        query = query.where(Namespace.scope == scope)
    rows = session.execute(query).all()
    return [ExtentSize(row.id, row.tenant_id, int(row.size_bytes), row.scope) for row in rows]
