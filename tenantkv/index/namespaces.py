"""Namespace rows: (tenant, scope, fingerprint) with its wrapped hashing key."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from .database import Database
from .schema import Namespace, Tenant


def scopes_of(session: Session, namespace_ids: Collection[bytes]) -> dict[bytes, str]:
    rows = session.execute(
        select(Namespace.id, Namespace.scope).where(Namespace.id.in_(list(namespace_ids)))
    )
    return {namespace_id: scope for namespace_id, scope in rows}


def find(
    session: Session, tenant: str, scope: str, fingerprint: str
) -> tuple[bytes | None, Namespace | None]:
    """(tenant id or None, the namespace row or None)."""
    tenant_id = session.scalar(select(Tenant.id).where(Tenant.name == tenant))
    if tenant_id is None:
        return None, None
    row = session.scalar(
        select(Namespace).where(
            Namespace.tenant_id == tenant_id,
            Namespace.scope == scope,
            Namespace.fingerprint == fingerprint,
        )
    )
    return tenant_id, row


def create(db: Database, row: Namespace) -> bool:
    """Insert ``row``; False when a concurrent creation of the same namespace won."""
    try:
        with db.write() as session:
            session.add(row)
    except IntegrityError:
        return False
    return True
