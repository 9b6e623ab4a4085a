"""What one node does to stay in step with the others sharing its index.

* :class:`LeaseKeeper` takes, renews and releases this node's leases on extents being read
  (see :mod:`tenantkv.index.leases`); after a release it removes the bytes of extents that left
  the index while the load read them.
* :class:`KeyEpochWatcher` notices key changes made by any node (rotation, retirement, a
  deletion) and makes the local keyring drop the clear keys it cached.

One daemon thread per cache does both, every few seconds; the hot path only touches the
index in the transactions it runs anyway.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Collection

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from ..index import counters, extents, leases
from ..index.database import Database
from .extent_removal import ExtentRemover
from .keyring import Keyring

logger = logging.getLogger("tenantkv")

DEFAULT_LEASE_SECONDS = 60.0
#: How old a lease is when its row is written: past a load's first layers, so the write does
#: not compete with them for the cores and the interpreter, and a load that ends sooner writes
#: no row at all (nor deletes one at its close). Rows are written at most once per this delay,
#: each in one transaction with every other lease as old, so a lease's row is written when it
#: is between one and two delays old.
LEASE_WRITE_DELAY_S = 0.02


def new_node_id() -> str:
    """A name for this process among the nodes: readable, and unique thanks to the suffix."""
    return f"{socket.gethostname()[:32]}:{os.getpid()}:{secrets.token_hex(4)}"


class LeaseKeeper:
    """This node's leases: one per running load, renewed until released.

    A lease holds on this node from the moment it is taken (:meth:`take`, no I/O: the load's
    first layer does not wait on an index write); its row, which every other node honours, is
    written in the background once the lease is ``LEASE_WRITE_DELAY_S`` old, together with the
    others as old (:meth:`persist_pending`). Until the row commits, another node could remove
    the extent; the load then still reads it through the files it already opened (POSIX keeps
    unlinked files readable), or fails with a typed error -- never wrong bytes. Every check of
    this node adds its local holds to the rows (:meth:`held`). A release deletes the lease's
    row on the caller's thread, unless the row is being written right then: the writer deletes
    it after (:meth:`release`), so that a stream's close never queues behind a stalled write.

    Why by age: an engine's hits come one step apart (every 20-30 ms), each load shorter than
    that. Writing every lease unwritten when the delay after the *first* one ran out wrote the
    row of the next hit's lease, taken a moment before, and that load's close then deleted it:
    two index writes for most hits, the deletion on the engine's thread inside its step
    (docs/perf.md, "vLLM: the OpenMP teams of the cache's threads").
    """

    def __init__(
        self,
        db: Database,
        remover: ExtentRemover,
        *,
        node_id: str,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        self.node_id = node_id
        self.lease_seconds = lease_seconds
        self._db = db
        self._remover = remover
        self._wall_clock = wall_clock
        self._clock = clock  # the leases' ages
        self._lock = threading.Lock()
        # Writes of lease rows and renewals, one at a time (the coordination thread's).
        self._writes = threading.Lock()
        self._active: dict[bytes, tuple[str, ...]] = {}
        self._unwritten: dict[bytes, float] = {}  # lease -> when taken (clock)
        # Leases whose rows are being written now, and those of them released meanwhile: the
        # writer deletes their rows once its write committed. A release never waits for a
        # write (on an index that stalls, a stream's close would wait out the writer's
        # timeout and then its own), nor deletes a row before it is written (an INSERT after
        # the DELETE would leave the row behind until it lapsed).
        self._writing: set[bytes] = set()
        self._released_while_writing: set[bytes] = set()
        self.pending = threading.Event()  # set when a lease waits for its row
        remover.held = self.held

    def take(self, extent_ids: Collection[str]) -> bytes:
        """Hold ``extent_ids`` for one load on this node now; return the lease id. Call
        :meth:`persist` (in the background) to make the other nodes honour it."""
        lease_id = secrets.token_bytes(16)
        with self._lock:
            self._active[lease_id] = tuple(dict.fromkeys(extent_ids))
            self._unwritten[lease_id] = self._clock()
        self.pending.set()
        return lease_id

    def next_due(self, age: float) -> float | None:
        """When (on ``clock``) the oldest lease without a row turns ``age`` old; None if every
        running lease has its row."""
        with self._lock:
            return min(self._unwritten.values()) + age if self._unwritten else None

    def persist_pending(self, min_age: float) -> bool:
        """Write the rows of every running lease at least ``min_age`` old whose row is not
        written yet, in one transaction. False if that failed: the leases stay pending, to be
        retried (they hold on this node meanwhile)."""
        with self._writes:
            with self._lock:
                taken_by = self._clock() - min_age
                batch = {
                    lease: (self._active[lease], taken)
                    for lease, taken in self._unwritten.items()
                    if taken <= taken_by
                }
                for lease in batch:
                    del self._unwritten[lease]
                self._writing.update(batch)
            if not batch:
                return True
            until = self._wall_clock() + self.lease_seconds
            written = True
            try:
                with self._db.write_connection(serving=True) as connection:
                    for lease_id, (extent_ids, _) in batch.items():
                        leases.acquire(connection, lease_id, self.node_id, extent_ids, until)
            except SQLAlchemyError as err:  # they hold on this node; retried later
                logger.warning("could not record leases for other nodes: %s", err)
                written = False
            with self._lock:
                self._writing.difference_update(batch)
                released = self._released_while_writing & batch.keys()
                self._released_while_writing -= released
                if not written:  # the running ones wait for their rows again
                    self._unwritten.update(
                        (lease, taken)
                        for lease, (_, taken) in batch.items()
                        if lease in self._active
                    )
            if written:
                for lease_id in released:  # released while their rows were written
                    self._delete_row(lease_id)
            return written

    def _delete_row(self, lease_id: bytes) -> bool:
        """Delete a released lease's row; False if the index refused (the row then lapses)."""
        try:
            with self._db.write_connection(serving=True) as connection:
                leases.release(connection, lease_id)
        except SQLAlchemyError as err:  # the lease lapses by itself
            logger.warning("could not release a lease (it lapses in time): %s", err)
            return False
        return True

    def release(self, lease_id: bytes, *, remove_unindexed: bool = True) -> None:
        """End a lease; then (unless the caller does it later) remove the bytes of its
        extents that were deleted from the index meanwhile.

        Its row, if written, is deleted here; if it is being written right now, the writer
        deletes it once written (the extents then stay held a moment longer, and their
        bytes are left for the sweep)."""
        with self._lock:
            extent_ids = self._active.pop(lease_id, ())
            # a row written or being written (else the lease never got one)
            has_row = self._unwritten.pop(lease_id, None) is None
            if has_row and lease_id in self._writing:
                self._released_while_writing.add(lease_id)
                return
        if has_row and not self._delete_row(lease_id):
            return
        if remove_unindexed:
            self.remove_unindexed(extent_ids)

    def held(self, session: Session, extent_ids: Collection[str] | None) -> set[str]:
        """Which of ``extent_ids`` (all, with ``None``) a load holds: a live lease row of any
        node, or a lease of this node not yet written."""
        found = leases.leased(session, extent_ids, self._wall_clock())
        local = self.local_extents()
        if extent_ids is not None:
            local &= set(extent_ids)
        return found | local

    def local_extents(self) -> set[str]:
        """Extents this node's running loads hold."""
        with self._lock:
            return {extent_id for ids in self._active.values() for extent_id in ids}

    def remove_unindexed(self, extent_ids: Collection[str]) -> None:
        """After a release committed: delete the bytes of extents that left the index while the
        lease kept them (the remover skips those another lease still holds)."""
        if not extent_ids:
            return
        try:
            with self._db.read(serving=True) as session:
                gone = set(extent_ids) - extents.indexed(session, extent_ids)
        except SQLAlchemyError as err:
            logger.warning("could not check released extents (left for the sweep): %s", err)
            return
        if gone:
            self._remover.remove_bytes(gone)

    def active(self) -> dict[bytes, tuple[str, ...]]:
        with self._lock:
            return dict(self._active)

    def forget(self, lease_id: bytes) -> None:
        """Stop holding and renewing ``lease_id`` here, as a node that died would (its row, if
        written, lapses)."""
        with self._lock:
            self._active.pop(lease_id, None)
            self._unwritten.pop(lease_id, None)

    def renew(self) -> None:
        """Extend every running load's lease by a full lifetime."""
        ids = list(self.active())
        if not ids:
            return
        with self._writes, self._db.write_connection(serving=True) as connection:
            leases.renew(connection, ids, self._wall_clock() + self.lease_seconds)

    def release_all(self) -> None:
        """At close: give back every lease this node still holds."""
        for lease_id in list(self.active()):
            self.release(lease_id)


class KeyEpochWatcher:
    """Drops the keyring's clear keys when any node changed any tenant's keys."""

    def __init__(self, db: Database, keyring: Keyring) -> None:
        self._db = db
        self._keyring = keyring
        self._seen: int | None = None

    def check(self) -> bool:
        """Read the epoch; on a change since the last check, clear the keyring. Returns
        whether it cleared."""
        with self._db.read_connection(serving=True) as connection:
            epoch = counters.read(connection, counters.KEY_EPOCH)
        changed = self._seen is not None and epoch != self._seen
        self._seen = epoch
        if changed:
            self._keyring.clear()
        return changed


class CoordinationThread:
    """Renews leases and watches the key epoch every ``interval`` seconds until stopped."""

    def __init__(
        self, keeper: LeaseKeeper, watcher: KeyEpochWatcher, interval: float | None = None
    ) -> None:
        self._keeper = keeper
        self._watcher = watcher
        self._interval = interval or min(2.0, keeper.lease_seconds / 3)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tenantkv-coord", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        next_round = time.monotonic() + self._interval
        while not self._stop.is_set():
            self._keeper.pending.wait(max(0.0, next_round - time.monotonic()))
            if self._stop.is_set():
                return
            try:
                if self._keeper.pending.is_set():
                    self._keeper.pending.clear()
                    self._write_rows_as_leases_age(until=next_round)
                if time.monotonic() >= next_round:
                    next_round = time.monotonic() + self._interval
                    self._keeper.persist_pending(LEASE_WRITE_DELAY_S)
                    self._keeper.renew()
                    self._watcher.check()
            except SQLAlchemyError as err:
                logger.warning("lease writes or the key-epoch check failed (retrying): %s", err)

    def _write_rows_as_leases_age(self, until: float) -> None:
        """Until no running lease lacks its row: wait for the oldest to turn
        ``LEASE_WRITE_DELAY_S`` old (a load that ends first needs none), then write every lease
        that old, at most once per delay. Returns at ``until``, the next round (renewals and
        the key-epoch check must not wait for a stream of loads to pause), to be called again
        after it. A failed write is left to the next round (or the next lease taken), as the
        index is then failing."""
        delay = LEASE_WRITE_DELAY_S
        written_at = -delay
        while (due := self._keeper.next_due(delay)) is not None:
            at = max(due, written_at + delay)
            if self._stop.wait(max(0.0, min(at, until) - time.monotonic())):
                return
            if at >= until:
                self._keeper.pending.set()  # back here once the round is done
                return
            written_at = time.monotonic()
            if not self._keeper.persist_pending(delay):
                return

    def stop(self) -> None:
        self._stop.set()
        self._keeper.pending.set()  # wake the thread
        if self._thread.is_alive():
            self._thread.join()
