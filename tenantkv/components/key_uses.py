"""Counts of inference key use, kept in memory and written to the index in batches.

A gateway authenticates every request with its key; a write per request (an audit record, or
an index update) would put a commit on every request's path and cap the gateway at the index's
commit rate. So :meth:`KeyUses.record` only adds to a count in memory, and the counts are
written together, one transaction for every key used meanwhile (``uses`` is added to, never
overwritten, so the nodes of a fleet add up), by a timer at most every ``interval`` seconds
after the first use of a batch, by a listing (so it shows what this node counted), and at
close. A batch that fails to write (the index is down) is kept and retried with the next.
What a node counted but had not written when it died is lost: the counts are metering, not
the audit log.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.exc import SQLAlchemyError

from ..index import inference_keys
from ..index.database import Database

logger = logging.getLogger("tenantkv")

#: Longest time a use waits in memory before its batch is written (while the cache is open).
DEFAULT_FLUSH_INTERVAL_S = 5.0


class KeyUses:
    """Pending counts of use per key id, and their batched write."""

    def __init__(self, db: Database, interval: float = DEFAULT_FLUSH_INTERVAL_S) -> None:
        if not interval > 0:
            raise ValueError("the flush interval must be positive")
        self._db = db
        self._interval = interval
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # one batch at a time: counts are added once
        #: key id -> (uses not yet written, time of the latest of them).
        self._pending: dict[str, tuple[int, float]] = {}
        self._timer: threading.Timer | None = None
        self._closed = False
        #: Batches written and batches that failed (logged, kept for the next): for tests.
        self.batches = 0
        self.failed = 0

    def record(self, key_id: str, at: float) -> None:
        """Count one use of ``key_id`` at ``at`` (no I/O); the first use of a batch starts its
        timer."""
        with self._lock:
            uses, latest = self._pending.get(key_id, (0, at))
            self._pending[key_id] = (uses + 1, max(latest, at))
            if self._timer is None and not self._closed:
                self._timer = threading.Timer(self._interval, self._on_timer)
                self._timer.daemon = True
                self._timer.start()

    def pending(self) -> dict[str, tuple[int, float]]:
        """What waits to be written (a copy)."""
        with self._lock:
            return dict(self._pending)

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
        self.flush()

    def flush(self) -> None:
        """Write every pending count in one transaction; on an index failure keep them (logged,
        never raised: counting must not fail a request or a close)."""
        with self._flushing:
            with self._lock:
                batch, self._pending = self._pending, {}
            if not batch:
                return
            try:
                with self._db.write() as session:
                    inference_keys.add_uses(session, batch)
            except SQLAlchemyError as err:
                self.failed += 1
                logger.warning("inference key use counts could not be written: %s", err)
                with self._lock:
                    for key_id, (uses, latest) in batch.items():
                        more, later = self._pending.get(key_id, (0, latest))
                        self._pending[key_id] = (uses + more, max(latest, later))
                return
            self.batches += 1

    def close(self) -> None:
        """Stop the timer and write what is pending (the cache is closing)."""
        with self._lock:
            self._closed = True
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self.flush()
