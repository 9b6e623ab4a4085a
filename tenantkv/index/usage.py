"""Metering rows: per tenant, scope and minute, added to by every node, never rewritten."""

from __future__ import annotations

from collections import Counter
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from .database import Database
from .schema import Tenant, Usage

FIELDS = (
    "hit_tokens",  # tokens a lookup found cached
    "miss_tokens",  # tokens a lookup asked for and did not find
    "served_tokens",  # tokens loaded from the cache
    "served_bytes",  # decoded bytes those loads handed to the caller (every layer of each token)
    "stored_tokens",
    "stored_bytes",
    "evicted_extents",  # removed to make room within the tenant's quota
    "evicted_bytes",
    "expired_extents",  # removed by retention
    "expired_bytes",
)


def add(
    session: Session, db: Database, pending: dict[tuple[bytes, str, int], Counter[str]]
) -> None:
    """Add counters to their buckets with additive upserts, so flushes from several processes
    or nodes sum up instead of overwriting each other."""
    # Counters of a tenant deleted meanwhile (a stale handle, a load that outlived the tenant)
    # have nowhere to go and must not block everyone else's. The tenant rows are locked first
    # (KEY SHARE, as the usage rows' foreign key would) and counters added in one order, so
    # that on PostgreSQL the flushes of several nodes and a tenant's deletion queue instead of
    # deadlocking on usage rows.
    live = set(
        session.scalars(
            select(Tenant.id)
            .where(Tenant.id.in_({key[0] for key in pending}))
            .order_by(Tenant.id)
            .with_for_update(key_share=True)
        ).all()
    )
    for (tenant_id, scope, bucket), counter in sorted(pending.items()):
        if tenant_id not in live:
            continue
        values: dict[str, Any] = {name: counter.get(name, 0) for name in FIELDS}
        insert = sqlite.insert(Usage) if db.dialect == "sqlite" else postgresql.insert(Usage)
        statement = insert.values(tenant_id=tenant_id, scope=scope, bucket=bucket, **values)
        statement = statement.on_conflict_do_update(
            index_elements=["tenant_id", "scope", "bucket"],
            set_={name: getattr(Usage, name) + statement.excluded[name] for name in FIELDS},
        )
        session.execute(statement)


def read(
    session: Session,
    tenant_id: bytes,
    scope: str | None,
    since: float | None,
    until: float | None,
) -> dict[str, int]:
    """The sums of the buckets whose start lies in ``[since, until)``."""
    columns = [func.coalesce(func.sum(getattr(Usage, name)), 0) for name in FIELDS]
    query = select(*columns).where(Usage.tenant_id == tenant_id)
    if scope is not None:
        query = query.where(Usage.scope == scope)
    if since is not None:
        query = query.where(Usage.bucket >= since)
    if until is not None:
        query = query.where(Usage.bucket < until)
    row = session.execute(query).one()
    return {name: int(value) for name, value in zip(FIELDS, row, strict=True)}


def read_all(
    session: Session, since: float | None, until: float | None
) -> dict[bytes, dict[str, int]]:
    """Every tenant's sums of the buckets whose start lies in ``[since, until)``, by tenant id:
    one grouped query, so an operator's table of all tenants costs one round trip."""
    columns = [func.coalesce(func.sum(getattr(Usage, name)), 0) for name in FIELDS]
    query = select(Usage.tenant_id, *columns).group_by(Usage.tenant_id)
    if since is not None:
        query = query.where(Usage.bucket >= since)
    if until is not None:
        query = query.where(Usage.bucket < until)
    return {
        bytes(row[0]): {name: int(value) for name, value in zip(FIELDS, row[1:], strict=True)}
        for row in session.execute(query).all()
    }
