"""Rings of recent writes, one per owner (a tenant), under one memory budget: one tenant's
large stores never push another tenant's just-written extents out of memory.

Durable stores write with ``O_DIRECT`` so that a large store evicts nobody's hot extents from
the page cache; the ring of recent writes (``recent_writes.py``) keeps what was just written
in memory for the next turn of a conversation. One shared ring would undo the first property
for the second: a tenant storing a 576 MB prefix would overwrite every other tenant's
just-written extents. So each owner writes into a ring of its own (``per_owner`` bytes, a
lazily touched anonymous mapping), and only its own stores move its ring on.

* **Bounded.** At most ``capacity // per_owner`` rings exist; memory is resident only where
  written, so the budget holds at ``capacity``.
* **Rings go to new owners only when idle.** An owner without a ring, when every ring is
  taken, gets the least recently used ring that no writer or reader is using (its extents are
  forgotten: their loads read the file, as without a ring); where every ring is in use, its
  extent is left out. A busy tenant's ring is never taken while it is being used.
* **The budget follows the host.** :func:`default_capacity` derives it from the memory
  available when the store opens (an eighth, at most 16 GiB), and :func:`default_per_owner`
  gives every owner at least enough for an 8K-token DeepSeek-V3 prefix (576 MB) where the
  budget allows it.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

from .base import ExtentReader
from .recent_writes import FileIdentity, RecentWrites, Reservation

GiB = 1 << 30

#: The most memory :func:`default_capacity` gives the rings, whatever the host holds.
MAX_DEFAULT_CAPACITY = 16 * GiB


def memory_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_capacity(available: int | None = None) -> int:
    """An eighth of the memory available (``available``, else read now), at most
    :data:`MAX_DEFAULT_CAPACITY`; 256 MiB where it cannot be told (the fixed default before)."""
    if available is None:
        available = memory_available()
    if available is None:
        return 256 << 20
    pages = min(available // 8, MAX_DEFAULT_CAPACITY) // mmap.PAGESIZE
    return max(pages, 1) * mmap.PAGESIZE


def default_per_owner(capacity: int) -> int:
    """One owner's ring: an eighth of ``capacity`` (eight tenants keep rings at once), but at
    least 1 GiB where ``capacity`` holds that much: a ring smaller than a prefix keeps none of
    it, and a long prefix is what a next turn most needs in memory."""
    return max(capacity // 8, min(capacity, GiB))


class OwnerRings:
    """The rings of recent writes of one store, one per owner; thread-safe.

    The interface of :class:`~.recent_writes.RecentWrites`, with an ``owner`` at
    :meth:`reserve`."""

    def __init__(self, capacity: int, per_owner: int | None = None) -> None:
        if capacity <= 0:
            raise ValueError("the rings need a positive capacity")
        per_owner = default_per_owner(capacity) if per_owner is None else per_owner
        if per_owner <= 0:
            raise ValueError("an owner's ring needs a positive size")
        self.per_owner = min(per_owner, capacity)
        self.capacity = capacity
        self.max_rings = max(1, capacity // self.per_owner)
        self._lock = threading.Lock()
        self._rings: dict[str, RecentWrites] = {}
        self._used: dict[str, int] = {}  # owner -> tick of its last reserve or open
        self._tick = 0
        self._closed = False
        # Counts of rings given back (their own counts restart when they move to a new owner).
        self._kept = self._left_out = self._served = 0
        #: Rings taken from an idle owner for a new one.
        self.reassigned = 0

    @property
    def kept(self) -> int:
        with self._lock:
            return self._kept + sum(ring.kept for ring in self._rings.values())

    @property
    def left_out(self) -> int:
        with self._lock:
            return self._left_out + sum(ring.left_out for ring in self._rings.values())

    @property
    def served(self) -> int:
        with self._lock:
            return self._served + sum(ring.served for ring in self._rings.values())

    def ring_of(self, owner: str) -> RecentWrites | None:
        """``owner``'s ring, if it has one (for tests and benchmarks)."""
        with self._lock:
            return self._rings.get(owner)

    def reserve(self, extent_id: str, size: int, owner: str = "") -> Reservation | None:
        """A region of ``owner``'s ring for ``extent_id`` (see :meth:`RecentWrites.reserve`),
        or None when it is not kept."""
        with self._lock:
            if self._closed:
                return None
            ring = self._rings.get(owner)
            if ring is None:
                ring = self._ring_for(owner)
                if ring is None:
                    self._left_out += 1
                    return None
            self._tick += 1
            self._used[owner] = self._tick
            # Under the lock: once the region is reserved the ring is in use, and no other
            # owner can be given it between the choice and the reservation.
            return ring.reserve(extent_id, size)

    def open(self, extent_id: str, identity_now: Callable[[], FileIdentity]) -> ExtentReader | None:
        """A reader of ``extent_id`` out of whichever ring holds it, or None."""
        with self._lock:
            found = [(o, r) for o, r in self._rings.items() if r.holds(extent_id)]
            if found:
                self._tick += 1
                self._used[found[0][0]] = self._tick
        for _owner, ring in found:
            reader = ring.open(extent_id, identity_now)
            if reader is not None:
                return reader
        return None

    def drop(self, extent_id: str) -> None:
        with self._lock:
            rings = list(self._rings.values())
        for ring in rings:
            ring.drop(extent_id)

    def holds(self, extent_id: str) -> bool:
        with self._lock:
            return any(ring.holds(extent_id) for ring in self._rings.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            rings = list(self._rings.values())
            self._rings.clear()
        for ring in rings:
            ring.close()

    def _ring_for(self, owner: str) -> RecentWrites | None:
        """Under the lock: a new ring for ``owner``, or the least recently used idle one."""
        if len(self._rings) < self.max_rings:
            ring = RecentWrites(self.per_owner)
            self._rings[owner] = ring
            return ring
        idle = [o for o, r in self._rings.items() if not r.in_use()]
        if not idle:
            return None
        oldest = min(idle, key=lambda o: self._used.get(o, 0))
        ring = self._rings.pop(oldest)
        self._used.pop(oldest, None)
        self._kept += ring.kept
        self._left_out += ring.left_out
        self._served += ring.served
        ring.reset()
        self._rings[owner] = ring
        self.reassigned += 1
        return ring


def ring_settings(total: int | None, per_owner: int | None) -> tuple[int, int | None]:
    """The rings' budget: ``total`` bytes (None: :func:`default_capacity`), and each owner's
    share (None: :func:`default_per_owner`). Raises ValueError for negative sizes."""
    if total is not None and total < 0:
        raise ValueError("the recent writes' memory must not be negative")
    if per_owner is not None and per_owner <= 0:
        raise ValueError("an owner's ring needs a positive size")
    capacity = default_capacity() if total is None else total
    return capacity, per_owner


__all__ = [
    "OwnerRings",
    "default_capacity",
    "default_per_owner",
    "memory_available",
    "ring_settings",
]
