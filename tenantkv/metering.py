"""Metering: per tenant and scope, what the cache did for it, and what that costs.

Counters are kept in memory on the hot path (a lookup must not write to the index) and added to
per-minute rows of ``tkv_usage`` when flushed: on ``usage()``, on close, and by the background
GC. Additive upserts make flushes from several processes or nodes sum up instead of overwrite.

Cost units price a token served from cache at ``hit_cost`` (default 1/50) of a token that was
looked up and missed (which the engine must then prefill), the way providers price hits.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite

from .database import Database
from .models import Tenant, Usage

BUCKET_SECONDS = 60
DEFAULT_HIT_COST = 1 / 50
FIELDS = (
    "hit_tokens",  # tokens a lookup found cached
    "miss_tokens",  # tokens a lookup asked for and did not find
    "served_tokens",  # tokens loaded from the cache
    "stored_tokens",
    "stored_bytes",
    "evicted_extents",  # removed to make room within the tenant's quota
    "evicted_bytes",
    "expired_extents",  # removed by retention
    "expired_bytes",
)

_Key = tuple[bytes, str, int]


@dataclass(frozen=True)
class UsageReport:
    tenant: str
    scope: str | None  # None: every scope of the tenant
    since: float | None
    until: float | None
    counters: dict[str, int]
    hit_cost: float

    @property
    def cost_units(self) -> float:
        """Misses cost 1 unit per token; tokens served from cache cost ``hit_cost`` each."""
        return self.counters["miss_tokens"] + self.hit_cost * self.counters["served_tokens"]

    def __getitem__(self, name: str) -> int:
        return self.counters[name]


class Meter:
    """Thread-safe in-memory counters, flushed additively to the index."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[_Key, Counter[str]] = {}

    def add(self, tenant_id: bytes, scope: str, at: float, **counts: int) -> None:
        key = (tenant_id, scope, int(at // BUCKET_SECONDS) * BUCKET_SECONDS)
        with self._lock:
            counter = self._pending.setdefault(key, Counter())
            for name, value in counts.items():
                assert name in FIELDS, f"unknown usage counter {name!r}"
                counter[name] += value

    def flush(self, db: Database) -> None:
        """Add pending counters to the index; on failure they stay pending for the next flush."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        try:
            with db.write() as session:
                # Counters of a tenant deleted meanwhile (a stale handle, a load that outlived
                # the tenant) have nowhere to go and must not block everyone else's. The tenant
                # rows are locked first (KEY SHARE, as the usage rows' foreign key would) and
                # counters added in one order, so that on PostgreSQL the flushes of several
                # nodes and a tenant's deletion queue instead of deadlocking on usage rows.
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
                    insert = (
                        sqlite.insert(Usage) if db.dialect == "sqlite" else postgresql.insert(Usage)
                    )
                    statement = insert.values(
                        tenant_id=tenant_id, scope=scope, bucket=bucket, **values
                    )
                    statement = statement.on_conflict_do_update(
                        index_elements=["tenant_id", "scope", "bucket"],
                        set_={
                            name: getattr(Usage, name) + statement.excluded[name] for name in FIELDS
                        },
                    )
                    session.execute(statement)
        except BaseException:
            with self._lock:
                for key, counter in pending.items():
                    self._pending.setdefault(key, Counter()).update(counter)
            raise

    def forget_tenant(self, tenant_id: bytes) -> None:
        with self._lock:
            for key in [k for k in self._pending if k[0] == tenant_id]:
                del self._pending[key]


def read_usage(
    db: Database,
    tenant_id: bytes,
    scope: str | None,
    since: float | None,
    until: float | None,
) -> dict[str, int]:
    """Sum the counters of the 60-second buckets whose start lies in ``[since, until)``, so
    adjacent windows add up exactly (a window shorter than a bucket may hold none)."""
    columns = [func.coalesce(func.sum(getattr(Usage, name)), 0) for name in FIELDS]
    query = select(*columns).where(Usage.tenant_id == tenant_id)
    if scope is not None:
        query = query.where(Usage.scope == scope)
    if since is not None:
        query = query.where(Usage.bucket >= since)
    if until is not None:
        query = query.where(Usage.bucket < until)
    with db.read() as session:
        row = session.execute(query).one()
    return {name: int(value) for name, value in zip(FIELDS, row, strict=True)}
