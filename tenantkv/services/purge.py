"""Purge a tenant's (or one scope's) cached prefixes, keeping the tenant and its keys.

The cache has no purge primitive, so this follows ``tenantkv.gc``'s order: the extents' index
rows are deleted first, in one write transaction that also carries the audit record, and their
files second (a crash in between leaves unindexed files for the orphan sweep, never index rows
without bytes). Extents a running load has pinned are left alone and counted as skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from ..audit import Attribution
from ..components.context import CacheContext
from ..errors import TenantNotFoundError
from ..index import extents
from ..index import tenants as tenant_rows

CACHE_PURGE: Final = "cache.purge"
#: ``(done, total)`` after each batch of files removed; what a job reports (``services.jobs``).
Progress = Callable[[int, int], None]
#: Files removed between two progress reports.
REMOVAL_BATCH: Final = 200


def remove_in_batches(ctx: CacheContext, ids: list[str], progress: Progress | None) -> int:
    """Remove the files of ``ids`` (already out of the index), reporting progress per batch;
    return how many went. A crash midway leaves unindexed files for GC's orphan sweep."""
    removed = 0
    if progress is not None:
        progress(0, len(ids))
    for start in range(0, len(ids), REMOVAL_BATCH):
        removed += ctx.remover.remove_bytes(ids[start : start + REMOVAL_BATCH])
        if progress is not None:
            progress(min(start + REMOVAL_BATCH, len(ids)), len(ids))
    return removed


@dataclass(frozen=True)
class PurgeReport:
    extents: int
    bytes: int
    skipped_in_use: int


def purge(
    ctx: CacheContext,
    by: Attribution,
    tenant: str,
    scope: str | None,
    progress: Progress | None = None,
) -> PurgeReport:
    """Remove every extent of ``tenant`` (of ``scope`` only, if given; ``""`` is the tenant-wide
    scope); raise TenantNotFoundError if there is no such tenant. ``progress`` follows the
    removal of the files (the index rows go first, in one transaction)."""
    ctx.runtime.check_open()
    with ctx.index.write() as session:
        # The tenant's row first, like every change to its extents (see quota.lock_tenants).
        tenant_id = tenant_rows.id_of(session, tenant, lock=True)
        if tenant_id is None:
            raise TenantNotFoundError(f"no tenant named {tenant!r}")
        rows = extents.of_tenant(session, tenant_id, scope)
        held = ctx.leases.held(session, [row.id for row in rows])
        chosen = [(row.id, int(row.size_bytes)) for row in rows if row.id not in held]
        ids = [extent_id for extent_id, _ in chosen]
        extents.delete_rows(session, ids)
        report = PurgeReport(
            extents=len(chosen),
            bytes=sum(size for _, size in chosen),
            skipped_in_use=len(rows) - len(chosen),
        )
        ctx.audit.append(
            session,
            by.event(
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
    remove_in_batches(ctx, ids, progress)  # bytes second
    return report
