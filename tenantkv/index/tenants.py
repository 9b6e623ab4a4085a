"""Tenant rows and their data-key versions."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from . import removals
from .extents import retention_by_class, retention_parameters
from .schema import DataKey, Extent, Namespace, Tenant


def find(session: Session, name: str, *, lock: bool = False) -> Tenant | None:
    """The tenant named ``name``; with ``lock``, its row locked for the transaction."""
    query = select(Tenant).where(Tenant.name == name)
    if lock:
        query = query.with_for_update()
    return session.scalar(query)


def get(session: Session, tenant_id: bytes) -> Tenant | None:
    return session.get(Tenant, tenant_id)


def id_of(session: Session, name: str, *, lock: bool = False) -> bytes | None:
    query = select(Tenant.id).where(Tenant.name == name)
    if lock:
        query = query.with_for_update()
    return session.scalar(query)


def all_by_name(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).order_by(Tenant.name)).all())


def names_and_ids(session: Session) -> list[tuple[bytes, str]]:
    return [(tid, name) for tid, name in session.execute(select(Tenant.id, Tenant.name)).all()]


def key_versions(session: Session, tenant_id: bytes) -> tuple[int, ...]:
    return tuple(
        session.scalars(
            select(DataKey.version).where(DataKey.tenant_id == tenant_id).order_by(DataKey.version)
        ).all()
    )


def add(session: Session, row: Tenant, wrapped_key: bytes) -> None:
    """Insert a tenant with its first data-key version."""
    session.add(row)
    session.flush()
    add_data_key(session, row.id, row.current_key_version, wrapped_key, row.created_at)


def add_data_key(
    session: Session, tenant_id: bytes, version: int, wrapped_key: bytes, now: float
) -> None:
    session.add(
        DataKey(tenant_id=tenant_id, version=version, wrapped_key=wrapped_key, created_at=now)
    )
    session.flush()


def restart_retention(session: Session, tenant_id: bytes, classes: Mapping[str, float]) -> None:
    """Extents of each class in ``classes`` (class -> seconds) expire that long after their
    last use; extents of other classes keep their expiry. One statement for all classes."""
    if not classes:
        return
    # Expiry may move earlier: nodes must stop trusting the expiry times they keep.
    removals.bump(session, namespace_ids(session, tenant_id))
    kinds, ttl = retention_by_class(len(classes))
    statement = (
        update(Extent)
        .where(Extent.tenant_id == tenant_id, Extent.kind.in_(kinds))
        .values(expires_at=Extent.last_used_at + ttl)
        .execution_options(synchronize_session=False)
    )
    session.execute(statement, retention_parameters(classes))


def extent_ids(
    session: Session, tenant_id: bytes, kinds: Collection[str] | None = None
) -> list[str]:
    """Ids of the tenant's extents (of the retention classes ``kinds`` only, if given)."""
    query = select(Extent.id).where(Extent.tenant_id == tenant_id)
    if kinds is not None:
        query = query.where(Extent.kind.in_(list(kinds)))
    return list(session.scalars(query).all())


def namespace_ids(session: Session, tenant_id: bytes) -> list[bytes]:
    return list(session.scalars(select(Namespace.id).where(Namespace.tenant_id == tenant_id)).all())


def shred(session: Session, row: Tenant) -> None:
    """Delete a tenant: its keys first (once this commits nothing left in the index opens its
    bytes), then its namespaces and the tenant (cascading to extents, blocks, usage)."""
    session.execute(delete(DataKey).where(DataKey.tenant_id == row.id))
    removals.forget(session, namespace_ids(session, row.id))
    session.execute(delete(Namespace).where(Namespace.tenant_id == row.id))
    session.delete(row)


def unused_old_versions(session: Session, tenant: Tenant) -> list[int]:
    """Key versions older than the current one that no extent is sealed with."""
    in_use = set(
        session.scalars(
            select(Extent.key_version).where(Extent.tenant_id == tenant.id).distinct()
        ).all()
    )
    versions = session.scalars(
        select(DataKey.version).where(
            DataKey.tenant_id == tenant.id, DataKey.version < tenant.current_key_version
        )
    ).all()
    return [v for v in versions if v not in in_use]


def delete_data_keys(session: Session, tenant_id: bytes, versions: Collection[int]) -> None:
    session.execute(
        delete(DataKey).where(DataKey.tenant_id == tenant_id, DataKey.version.in_(list(versions)))
    )


def wrapped_data_key(session: Session, tenant_id: bytes, version: int) -> bytes | None:
    return session.scalar(
        select(DataKey.wrapped_key).where(
            DataKey.tenant_id == tenant_id, DataKey.version == version
        )
    )


def count_extents_with_old_keys(session: Session, tenant: Tenant) -> int:
    return int(
        session.scalar(
            select(func.count())
            .select_from(Extent)
            .where(Extent.tenant_id == tenant.id, Extent.key_version < tenant.current_key_version)
        )
        or 0
    )
