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

from ..config import CacheConfig
from ..index import usage
from ..index.database import Database
from ..index.usage import FIELDS

USAGE_FIELDS = FIELDS  # the counters every report has, for the layers above the index

BUCKET_SECONDS = 60
DEFAULT_HIT_COST: float = CacheConfig.hit_cost  # the default lives in CacheConfig

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

    @property
    def hit_ratio(self) -> float | None:
        """Tokens found cached over tokens looked up (None: nothing was looked up)."""
        looked_up = self.counters["hit_tokens"] + self.counters["miss_tokens"]
        return None if looked_up == 0 else self.counters["hit_tokens"] / looked_up

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
                usage.add(session, db, pending)
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
    with db.read() as session:
        return usage.read(session, tenant_id, scope, since, until)


def read_usage_all(
    db: Database, since: float | None, until: float | None
) -> dict[bytes, dict[str, int]]:
    """Every tenant's sums over the buckets starting in ``[since, until)``, by tenant id (a
    tenant with no bucket in the window is absent)."""
    with db.read() as session:
        return usage.read_all(session, since, until)
