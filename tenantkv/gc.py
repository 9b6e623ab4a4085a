"""Garbage collection: expired extents, bytes left behind, and pending metering.

Crash-safe by ordering: an extent's index rows are deleted (and committed) first, its bytes
second. A crash between the two leaves an unindexed file, which the orphan sweep removes later;
it never leaves an index row pointing at missing bytes (which would be a miss, but a confusing
one). The sweep spares files younger than ``orphan_grace`` seconds, because a store writes its
file just before it indexes it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import delete, select
from sqlalchemy.exc import SQLAlchemyError

from .audit import USAGE_SUMMARY, chain_for
from .metering import BUCKET_SECONDS, read_usage
from .models import Block, Extent, Namespace, SchemaInfo, Tenant
from .quota import lock_tenants
from .storage import StorageError

if TYPE_CHECKING:
    from .cache import TenantKV

Progress = Callable[[int, int], None]  # (done, total)
_BATCH = 200
_SUMMARY_MARK = "usage_summary_until"


@dataclass(frozen=True)
class GcReport:
    expired_extents: int
    expired_bytes: int
    orphans_removed: int
    temporary_removed: int


def collect(
    kv: TenantKV, *, orphan_grace: float = 600.0, progress: Progress | None = None
) -> GcReport:
    now = kv.clock()
    with kv.db.read() as session:
        expired = session.execute(
            select(Extent.id, Extent.tenant_id, Extent.size_bytes, Namespace.scope)
            .join(Namespace, Namespace.id == Extent.namespace_id)
            .where(Extent.expires_at <= now)
            .order_by(Extent.expires_at)
        ).all()
    pinned = kv.pinned_extents()
    expired = [row for row in expired if row.id not in pinned]  # a running load keeps its bytes
    existing = list(kv.store_backend.list())
    total = len(expired) + len(existing)
    done = 0
    removed_bytes = 0
    for start in range(0, len(expired), _BATCH):
        batch = expired[start : start + _BATCH]
        ids = [row.id for row in batch]
        with kv.db.write() as session:  # index first ...
            lock_tenants(session, {row.tenant_id for row in batch})
            session.execute(delete(Block).where(Block.extent_id.in_(ids)))
            session.execute(delete(Extent).where(Extent.id.in_(ids)))
        for row in batch:  # ... bytes second
            kv.delete_extent_file(row.id)
            kv.meter.add(
                row.tenant_id, row.scope, now, expired_extents=1, expired_bytes=row.size_bytes
            )
            removed_bytes += row.size_bytes
        done += len(batch)
        if progress is not None:
            progress(done, total)
    collected = {row.id for row in expired}
    orphans = _sweep_orphans(
        kv, [e for e in existing if e not in collected], now - orphan_grace, progress, done, total
    )
    temporary = kv.store_backend.sweep_temporary(older_than=now - orphan_grace)
    try:
        kv.meter.flush(kv.db)
        _audit_maintenance(kv, now)
    except SQLAlchemyError as err:  # metering and summaries are retried at the next run
        kv.log.warning("metering flush or audit maintenance failed: %s", err)
    return GcReport(len(expired), removed_bytes, orphans, temporary)


def _audit_maintenance(kv: TenantKV, now: float) -> None:
    """Periodic audit work, in one transaction: a usage summary per active tenant for the
    complete minutes since the last run (not one record per lookup), a signed checkpoint of
    each chain that grew, and the purge of audit records past their own retention."""
    until = float(int(now // BUCKET_SECONDS) * BUCKET_SECONDS)
    with kv.db.write() as session:
        # Nodes collecting at once take turns, so that each reads the mark the one before it
        # left (on PostgreSQL they would all read the old mark and each summarise the minutes).
        kv.db.take_turns(session, "audit-maintenance")
        mark = session.get(SchemaInfo, _SUMMARY_MARK)
        since = float(mark.value) if mark is not None else None
        chains = ["system"]
        if since is None or until > since:
            for tenant_id, name in session.execute(select(Tenant.id, Tenant.name)).all():
                counters = read_usage(kv.db, tenant_id, None, since, until)
                if any(counters.values()):
                    details: dict[str, object] = {"since": since, "until": until, **counters}
                    kv.audit.append(
                        session, kv.attribution.event(name, USAGE_SUMMARY, name, details=details)
                    )
                    chains.append(chain_for(name))
            session.merge(SchemaInfo(name=_SUMMARY_MARK, value=repr(until)))
        kv.audit.purge_expired(session)
        for chain in chains:
            kv.audit.checkpoint(session, chain)


def _sweep_orphans(
    kv: TenantKV,
    existing: list[str],
    cutoff: float,
    progress: Progress | None,
    done: int,
    total: int,
) -> int:
    removed = 0
    for start in range(0, len(existing), _BATCH):
        batch = existing[start : start + _BATCH]
        with kv.db.read() as session:
            indexed = set(session.scalars(select(Extent.id).where(Extent.id.in_(batch))).all())
        for extent_id in batch:
            if extent_id in indexed or extent_id in kv.pinned_extents():
                continue
            try:
                if kv.store_backend.modified_at(extent_id) > cutoff:
                    continue  # possibly a store between writing and indexing
                removed += kv.store_backend.delete(extent_id)
            except StorageError as err:
                kv.log.warning("orphan sweep could not remove %s: %s", extent_id, err)
        done += len(batch)
        if progress is not None:
            progress(done, total)
    if progress is not None and done < total:
        progress(total, total)  # the extents collected above were counted twice in the total
    return removed


class BackgroundGc:
    """Runs :func:`collect` every ``interval`` seconds on a daemon thread until stopped."""

    def __init__(self, kv: TenantKV, interval: float) -> None:
        self._kv = kv
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tenantkv-gc", daemon=True)
        self.runs = 0
        self.last_report: GcReport | None = None

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.last_report = collect(self._kv)
                self.runs += 1
            except (SQLAlchemyError, StorageError) as err:
                self._kv.log.warning("background GC failed (retrying next round): %s", err)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def text_progress(prefix: str = "gc") -> Progress:
    """A progress bar on stderr for the CLI."""

    def show(done: int, total: int) -> None:
        width = 30
        filled = width * done // total if total else width
        sys.stderr.write(f"\r{prefix} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show
