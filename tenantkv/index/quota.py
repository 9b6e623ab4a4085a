"""Quotas: each tenant's reserved share of the store, and eviction within it.

Quotas reserve capacity: the sum of all tenants' quotas may not exceed the store's capacity
(unless an operator allows overcommit, which weakens isolation and is recorded). So a tenant can
only ever evict its own data: a store that would exceed its quota evicts that tenant's least
recently used extents -- never another tenant's, and never one a running load is reading.

The unit of eviction is the extent (one store call's blocks), because that is the unit in
which bytes are freed. Ties in last use go to the most recently created extent first, which
holds the later blocks of a prefix, so shorter prefixes stay usable.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..errors import QuotaExceededError
from . import extents
from .schema import Extent, Tenant


@dataclass(frozen=True)
class Evicted:
    extent_id: str
    namespace_id: bytes
    size_bytes: int
    expired: bool


def lock_tenants(session: Session, tenant_ids: Collection[bytes]) -> None:
    """Lock the rows of these tenants, in id order, before changing any of their extents.

    Every transaction that adds, deletes or updates a tenant's extents (stores, evictions,
    quota and retention changes, GC, purges, re-sealing, recording use) takes its tenant's row
    first, so on PostgreSQL, where they run side by side, they queue on that row instead of
    deadlocking on extent and block rows locked in different orders. SQLite's write
    transactions are exclusive; its SQL has no FOR UPDATE.
    """
    session.execute(
        select(Tenant.id)
        .where(Tenant.id.in_(sorted(tenant_ids)))
        .order_by(Tenant.id)
        .with_for_update()
    )


def tenant_bytes(session: Session, tenant_id: bytes) -> int:
    return int(
        session.scalar(
            select(func.coalesce(func.sum(Extent.size_bytes), 0)).where(
                Extent.tenant_id == tenant_id
            )
        )
        or 0
    )


def total_quota(session: Session, excluding: bytes | None = None) -> int:
    query = select(func.coalesce(func.sum(Tenant.quota_bytes), 0))
    if excluding is not None:
        query = query.where(Tenant.id != excluding)
    return int(session.scalar(query) or 0)


def make_room(
    session: Session,
    tenant_id: bytes,
    quota: int,
    now: float,
    *,
    held: Callable[[Collection[str]], set[str]],
    keep: str | None = None,
    evict_leased: bool = False,
) -> list[Evicted]:
    """Delete the tenant's index rows of expired, then least recently used, extents until its
    bytes fit ``quota``; return what was deleted (the caller removes the bytes after commit).

    ``keep`` (the extent being stored) is never chosen, nor is an extent that a running load
    holds (``held``: which of the given extents some node's load holds, see
    ``LeaseKeeper.held``) -- unless ``evict_leased``
    (an operator lowering the quota): then leased extents go last, leaving the index at once
    while their bytes stay until the lease ends. Raises QuotaExceededError, changing nothing,
    when that is not enough.
    """
    used = tenant_bytes(session, tenant_id)
    if used <= quota:
        return []
    candidates = session.execute(
        select(Extent.id, Extent.namespace_id, Extent.size_bytes, Extent.expires_at)
        .where(Extent.tenant_id == tenant_id)
        .order_by(
            (Extent.expires_at > now).asc(),  # expired ones first
            Extent.last_used_at.asc(),
            Extent.created_at.desc(),
        )
    ).all()
    in_use = held([row.id for row in candidates])
    chosen: list[Evicted] = []
    passes = (False, True) if evict_leased else (False,)
    for take_leased in passes:
        for extent_id, namespace_id, size, expires_at in candidates:
            if used <= quota:
                break
            if extent_id == keep or (extent_id in in_use) != take_leased:
                continue
            chosen.append(Evicted(extent_id, namespace_id, size, expires_at <= now))
            used -= size
    if used > quota:
        raise QuotaExceededError(
            f"the tenant's quota of {quota} bytes cannot take this store: {used} bytes would "
            "remain after evicting everything not in use by a running load"
        )
    extents.delete_rows(session, [e.extent_id for e in chosen])
    return chosen
