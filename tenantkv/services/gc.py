"""Garbage collection: expired extents, bytes left behind, and pending metering.

Crash-safe by ordering: an extent's index rows are deleted (and committed) first, its bytes
second. A crash between the two leaves an unindexed file, which the orphan sweep removes later;
it never leaves an index row pointing at missing bytes (which would be a miss, but a confusing
one). The sweep spares files younger than ``orphan_grace`` seconds, because a store writes its
file just before it indexes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError

from ..audit import USAGE_SUMMARY, AuditError
from ..components.context import CacheContext
from ..components.metering import BUCKET_SECONDS, read_usage
from ..index import extents, leases, settings
from ..index import tenants as tenant_rows
from ..index.quota import lock_tenants
from ..storage import StorageError
from .shredding import retry_pending_scrub

logger = logging.getLogger("tenantkv")
Progress = Callable[[int, int], None]  # (done, total)
_BATCH = 200


@dataclass(frozen=True)
class GcReport:
    expired_extents: int
    expired_bytes: int
    orphans_removed: int
    temporary_removed: int


def collect(
    ctx: CacheContext, *, orphan_grace: float = 600.0, progress: Progress | None = None
) -> GcReport:
    now = ctx.clock()
    with ctx.index.read() as session:
        expired = extents.expired(session, now)
    with ctx.index.read() as session:  # a running load on any node keeps its extents
        held = ctx.leases.held(session, [row.id for row in expired])
    expired = [row for row in expired if row.id not in held]
    names = _tenant_names(ctx) if expired and ctx.metrics.tenant_labels else {}
    # A store that cannot list cheaply (Redis: a SCAN of the whole key space) is not swept:
    # its orphans expire by the TTL every commit sets (StoreCapabilities.expires).
    existing = list(ctx.blocks.list()) if ctx.blocks.capabilities.cheap_listing else []
    total = len(expired) + len(existing)
    done = 0
    removed_bytes = 0
    for start in range(0, len(expired), _BATCH):
        batch = expired[start : start + _BATCH]
        ids = [row.id for row in batch]
        with ctx.index.write() as session:  # index first ...
            lock_tenants(session, {row.tenant_id for row in batch})
            extents.delete_rows(session, ids)
        ctx.remover.remove_bytes(ids)  # ... bytes second
        for row in batch:
            ctx.meter.add(
                row.tenant_id, row.scope, now, expired_extents=1, expired_bytes=row.size_bytes
            )
            ctx.metrics.removed(names.get(row.tenant_id, ""), 1, row.size_bytes, expired=True)
            removed_bytes += row.size_bytes
        done += len(batch)
        if progress is not None:
            progress(done, total)
    collected = {row.id for row in expired}
    orphans = _sweep_orphans(
        ctx, [e for e in existing if e not in collected], now - orphan_grace, progress, done, total
    )
    temporary = ctx.blocks.sweep_temporary(older_than=now - orphan_grace)
    try:
        with ctx.index.write() as session:  # leases of nodes that stopped renewing them
            leases.drop_lapsed(session, time.time())
        ctx.meter.flush(ctx.index)
        _audit_maintenance(ctx, now)
        ctx.audit.anchor(ctx.index.read)  # after the commit: anchors name committed heads only
    except SQLAlchemyError as err:  # metering and summaries are retried at the next run
        logger.warning("metering flush or audit maintenance failed: %s", err)
    except (AuditError, OSError) as err:  # tampering or an unwritable anchor file: say so loudly
        logger.error("audit integrity check or anchoring failed: %s", err)
    retry_pending_scrub(ctx)  # shredded keys a reader's snapshot kept in the index's files
    return GcReport(len(expired), removed_bytes, orphans, temporary)


def _tenant_names(ctx: CacheContext) -> dict[bytes, str]:
    """Tenant names by id, for metrics labelled by tenant (one query per GC run, and only
    when those labels are enabled)."""
    with ctx.index.read() as session:
        return dict(tenant_rows.names_and_ids(session))


def _audit_maintenance(ctx: CacheContext, now: float) -> None:
    """Periodic audit work, in one transaction: a usage summary per active tenant for the
    complete minutes since the last run (not one record per lookup), a signed checkpoint of
    each chain that grew, and the purge of audit records past their own retention."""
    until = float(int(now // BUCKET_SECONDS) * BUCKET_SECONDS)
    with ctx.index.write() as session:
        # Nodes collecting at once take turns, so that each reads the mark the one before it
        # left (on PostgreSQL they would all read the old mark and each summarise the minutes).
        ctx.index.take_turns(session, "audit-maintenance")
        mark = settings.get(session, settings.USAGE_SUMMARY_MARK)
        since = float(mark) if mark is not None else None
        chains = ["system"]
        if since is None or until > since:
            for tenant_id, name in tenant_rows.names_and_ids(session):
                counters = read_usage(ctx.index, tenant_id, None, since, until)
                if any(counters.values()):
                    details: dict[str, object] = {"since": since, "until": until, **counters}
                    event = ctx.attribution.event(
                        name, USAGE_SUMMARY, name, details=details, tenant_id=tenant_id
                    )
                    chains.append(ctx.audit.append(session, event).chain)
            settings.put(session, settings.USAGE_SUMMARY_MARK, repr(until))
        ctx.audit.purge_expired(session)
        for chain in chains:
            ctx.audit.checkpoint(session, chain)


def _sweep_orphans(
    ctx: CacheContext,
    existing: list[str],
    cutoff: float,
    progress: Progress | None,
    done: int,
    total: int,
) -> int:
    removed = 0
    for start in range(0, len(existing), _BATCH):
        batch = existing[start : start + _BATCH]
        with ctx.index.read() as session:
            indexed = extents.indexed(session, batch)
            # An evicted extent a load still reads is unindexed but not an orphan yet.
            indexed |= ctx.leases.held(session, batch)
        for extent_id in batch:
            if extent_id in indexed:
                continue
            try:
                if ctx.blocks.modified_at(extent_id) > cutoff:
                    continue  # possibly a store between writing and indexing
                removed += ctx.blocks.delete(extent_id)
            except StorageError as err:
                logger.warning("orphan sweep could not remove %s: %s", extent_id, err)
        done += len(batch)
        if progress is not None:
            progress(done, total)
    if progress is not None and done < total:
        progress(total, total)  # the extents collected above were counted twice in the total
    return removed


class BackgroundGc:
    """Runs :func:`collect` every ``interval`` seconds on a daemon thread until stopped."""

    def __init__(self, ctx: CacheContext, interval: float) -> None:
        self._ctx = ctx
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
                self.last_report = collect(self._ctx)
                self.runs += 1
            except (SQLAlchemyError, StorageError) as err:
                logger.warning("background GC failed (retrying next round): %s", err)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
