"""Purge a tenant's (or one scope's) cached prefixes, keeping the tenant and its keys.

The cache has no purge primitive, so this follows ``tenantkv.gc``'s order: the extents' index
rows are deleted first, in one write transaction that also carries the audit record, and their
files second (a crash in between leaves unindexed files for the orphan sweep, never index rows
without bytes). Extents a running load has pinned are left alone and counted as skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from sqlalchemy import delete, select

from ..errors import TenantNotFoundError
from ..models import Block, Extent, Namespace, Tenant
from .caller import Caller

if TYPE_CHECKING:
    from ..cache import TenantKV

CACHE_PURGE: Final = "cache.purge"


@dataclass(frozen=True)
class PurgeReport:
    extents: int
    bytes: int
    skipped_in_use: int


def purge(kv: TenantKV, caller: Caller, tenant: str, scope: str | None) -> PurgeReport:
    """Remove every extent of ``tenant`` (of ``scope`` only, if given; ``""`` is the tenant-wide
    scope); raise TenantNotFoundError if there is no such tenant."""
    kv.check_open()
    pinned = kv.pinned_extents()
    with kv.db.write() as session:
        # The tenant's row first, like every change to its extents (see quota.lock_tenants).
        tenant_id = session.scalar(select(Tenant.id).where(Tenant.name == tenant).with_for_update())
        if tenant_id is None:
            raise TenantNotFoundError(f"no tenant named {tenant!r}")
        query = select(Extent.id, Extent.size_bytes).where(Extent.tenant_id == tenant_id)
        if scope is not None:
            query = query.join(Namespace, Namespace.id == Extent.namespace_id).where(
                Namespace.scope == scope
            )
        rows = session.execute(query).all()
        chosen = [(row.id, int(row.size_bytes)) for row in rows if row.id not in pinned]
        ids = [extent_id for extent_id, _ in chosen]
        for start in range(0, len(ids), 500):
            batch = ids[start : start + 500]
            session.execute(delete(Block).where(Block.extent_id.in_(batch)))
            session.execute(delete(Extent).where(Extent.id.in_(batch)))
        report = PurgeReport(
            extents=len(chosen),
            bytes=sum(size for _, size in chosen),
            skipped_in_use=len(rows) - len(chosen),
        )
        kv.audit.append(
            session,
            caller.event(
                tenant,
                CACHE_PURGE,
                tenant if scope is None else f"{tenant}/{scope}",
                details={
                    "scope": scope,
                    "extents": report.extents,
                    "bytes": report.bytes,
                    "skipped_in_use": report.skipped_in_use,
                },
            ),
        )
    for extent_id in ids:  # bytes second
        kv.delete_extent_file(extent_id)
    return report
