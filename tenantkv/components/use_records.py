"""Records of use: when loads read which extents, written to the index in batches.

Each load's use restarts its extents' retention and tells LRU eviction about it: an index write
after the load closes, in the background (``Runtime.submit_background``: after the next loads'
first layers). One write transaction per load capped the bookkeeping thread at its commit rate:
small loads on PostgreSQL (1.5-2 ms a commit) arrived faster than that, and the backlog, and the
delay of every record in it, grew without bound (docs/perf.md, "Records of use in batches").
So records wait here, and a batch writes all those that arrived while it waited for its turn:
one transaction per tenant (not one for all: a tenant's transaction locks its row, and one
tenant's writers must not hold up another's stores through a shared batch); an extent loaded
several times in a batch is written once, at its latest use. What has not been written when
the cache closes is written by :meth:`UseRecords.flush`.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable

from sqlalchemy.exc import SQLAlchemyError

from ..index import extents
from ..index.database import Database
from ..index.plan import record_use
from ..storage import BlockStore, StorageError
from .extent_removal import ExtentRemover

logger = logging.getLogger("tenantkv")

#: Hands a task to the background (``Runtime.submit_background``): it may drop the task once
#: the cache is closing, which :meth:`UseRecords.flush` at close makes up for.
Submit = Callable[[Callable[[], object]], None]


class UseRecords:
    """Pending records of use, and the batched write of them."""

    def __init__(
        self, db: Database, blocks: BlockStore, remover: ExtentRemover, submit: Submit
    ) -> None:
        self._db = db
        self._blocks = blocks
        self._remover = remover
        self._submit = submit
        self._lock = threading.Lock()
        #: tenant id -> extent id -> time of its latest use not yet written.
        self._pending: dict[bytes, dict[str, float]] = {}
        #: tenant id -> loads whose use waits in ``_pending``.
        self._pending_loads: dict[bytes, int] = {}
        #: Loads recorded, loads whose use was written, and loads whose write failed (logged);
        #: ``recorded - written - failed`` wait to be written (for tests and benchmarks).
        self.recorded = 0
        self.written = 0
        self.failed = 0

    def record(self, tenant_id: bytes, extent_ids: Iterable[str], used_at: float) -> None:
        """Note that a load of ``tenant_id`` read ``extent_ids`` at ``used_at`` (the index's
        clock); the first record of a batch hands its write to the background."""
        with self._lock:
            starts_batch = not self._pending
            self.recorded += 1
            self._pending_loads[tenant_id] = self._pending_loads.get(tenant_id, 0) + 1
            uses = self._pending.setdefault(tenant_id, {})
            for extent_id in extent_ids:
                if uses.get(extent_id, used_at) <= used_at:
                    uses[extent_id] = used_at
        if starts_batch:
            self._submit(self.flush)

    @property
    def pending(self) -> int:
        """Extents whose use is not yet written (for tests and benchmarks)."""
        with self._lock:
            return sum(len(uses) for uses in self._pending.values())

    def flush(self) -> None:
        """Write every pending record, a transaction per tenant, then remove the bytes of
        extents that left the index while loads kept them. Bookkeeping only: never raises for
        the index or the store (logged; the orphan sweep removes bytes left behind)."""
        with self._lock:
            batch, self._pending = self._pending, {}
            loads, self._pending_loads = self._pending_loads, {}
        for tenant_id in sorted(batch):
            self._write(tenant_id, batch[tenant_id], loads.get(tenant_id, 0))

    def _write(self, tenant_id: bytes, uses: dict[str, float], loads: int) -> None:
        try:
            with self._db.write_connection() as connection:
                classes = record_use(connection, tenant_id, _by_time(uses))
                gone = set(uses) - extents.indexed(connection, uses)
        except SQLAlchemyError as err:
            logger.warning("could not record extent use: %s", err)
            with self._lock:
                self.failed += loads
            return  # bytes of extents that left the index are the orphan sweep's then
        with self._lock:
            self.written += loads
        if classes and self._blocks.capabilities.expires:
            # The store forgets extents by itself: restart their TTL too. The store applies
            # its own rule (Redis: one fixed TTL for every extent, which reveals no class); the
            # tenant's longest class is the hint its interface takes.
            try:
                self._blocks.retain(set(uses) - gone, max(classes.values()))
            except StorageError as err:
                logger.warning("could not extend extent TTLs in the block store: %s", err)
        if gone:
            try:
                self._remover.remove_bytes(gone)
            except SQLAlchemyError as err:
                logger.warning("could not check leases of unindexed extents: %s", err)


def _by_time(uses: dict[str, float]) -> dict[float, list[str]]:
    """Extents grouped by the time of their latest use: one group per load at most, and one
    for a prefix loaded again and again however many of its loads the batch holds."""
    groups: dict[float, list[str]] = defaultdict(list)
    for extent_id, used_at in uses.items():
        groups[used_at].append(extent_id)
    return dict(groups)
