"""Counts for operators (``TenantKV.info``)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from .schema import Block, Extent, Namespace, Tenant


def counts(session: Session) -> dict[str, int]:
    def count(table: type) -> int:
        return int(session.scalar(select(func.count()).select_from(table)) or 0)

    size = func.sum(Extent.num_blocks * Extent.num_layers * Extent.segment_bytes)
    stored_bytes = session.scalar(select(func.coalesce(size, 0))) or 0
    return {
        "tenants": count(Tenant),
        "namespaces": count(Namespace),
        "extents": count(Extent),
        "blocks": count(Block),
        "stored_bytes": int(stored_bytes),
    }
