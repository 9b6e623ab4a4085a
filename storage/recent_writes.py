"""The sealed bytes of the extents this process wrote last, kept in a ring of memory, so that
the first loads of a prefix just stored read memory instead of the device.

Durable stores write extents with ``O_DIRECT``, past the page cache (faster stores where
page-cache pages are costly, and a large store evicts nobody's hot extents), so the first load
of a prefix just stored read the device: 28-34 ms for a 32 MiB prefix on the development VMs
against 9 ms out of memory, and an engine's next request with the same prompt is exactly that
load (docs/perf.md, "A ring of recently written extents").

* **No copy, no new page faults.** The ring is one anonymous mapping. A writer reserves its
  extent's whole size at the ring's head, page-aligned (so the extent's pages line up with the
  file's), hands out slices of the region as the sealers' scratch memory, and the ``O_DIRECT``
  writes go out from there: keeping the bytes costs the store nothing more. Once the ring has
  been written round, its pages stay resident and are reused.
* **Never other bytes than the file's.** Only an extent whose every byte went through its
  writer, and whose commit succeeded, becomes readable. A reader checks at open that the file
  is still the one written (device, inode and size): a file deleted or replaced behind the
  store's back reads as it would without the ring. Deleting an extent drops it at once.
* **Regions in use are never overwritten.** A reservation that would overlap an extent being
  written, or one a load is reading, leaves the new extent out of the ring (it is written to
  the file as before).
* **Bounded.** ``capacity`` bytes of address space, resident once written; an extent larger
  than the ring is not kept.

One thing it changes: damage done to an extent's file *in place* (same inode) while the
extent is still in the ring is found only when the ring has moved on and a load reads the
file. Loads authenticate every segment either way; the ring serves the bytes that were
sealed, never others.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from typing_extensions import Buffer

from .base import ExtentReader, copy_from_view
from .errors import StorageError

#: What identifies a file: a replaced or truncated file differs in one of these.
FileIdentity = tuple[int, int, int]


def file_identity(path: str | os.PathLike[str]) -> FileIdentity:
    """(device, inode, size) of ``path``; raises ``OSError`` (``FileNotFoundError``)."""
    info = os.stat(path)
    return info.st_dev, info.st_ino, info.st_size


@dataclass(eq=False)
class _Entry:
    """One extent's region of the ring."""

    extent_id: str
    start: int
    length: int  # bytes of the ring it holds (whole pages)
    users: int = 1  # its writer, then each open reader
    size: int = 0  # the extent's size, once readable
    identity: FileIdentity | None = None  # its file's, once readable
    dropped: bool = False  # deleted or replaced while in use: removed by its last user


class Reservation:
    """A writer's region of the ring, until :meth:`commit` or :meth:`abort`."""

    def __init__(self, ring: RecentWrites, entry: _Entry, view: memoryview) -> None:
        self._ring = ring
        self._entry = entry
        #: The extent's bytes, as the writer fills them (``size`` bytes reserved).
        self.view = view
        self._done = False

    def commit(self, size: int, identity: FileIdentity) -> None:
        """The extent (its first ``size`` bytes) was committed as the file ``identity``."""
        if not self._done:
            self._done = True
            self._ring.publish(self._entry, size, identity)

    def abort(self) -> None:
        """Leave the extent out of the ring; idempotent."""
        if not self._done:
            self._done = True
            self._ring.release(self._entry)


class RecentWrites:
    """The ring; thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("the ring needs a positive capacity")
        self.capacity = -(-capacity // mmap.PAGESIZE) * mmap.PAGESIZE
        self._memory: mmap.mmap | None = mmap.mmap(-1, self.capacity)
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []  # every region in use or readable
        self._readable: dict[str, _Entry] = {}
        self._head = 0
        #: Extents kept, extents left out (too large, or the ring's space was in use), and
        #: opens served from the ring (for tests and benchmarks).
        self.kept = 0
        self.left_out = 0
        self.served = 0

    def reserve(self, extent_id: str, size: int) -> Reservation | None:
        """A region of ``size`` bytes for the extent ``extent_id`` about to be written, or None
        when it is not kept (larger than the ring, or its place is in use)."""
        length = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        with self._lock:
            if self._memory is None or size <= 0 or length > self.capacity:
                self.left_out += 1
                return None
            start = self._head if self._head + length <= self.capacity else 0
            end = start + length
            overlapping = [e for e in self._entries if e.start < end and start < e.start + e.length]
            if any(entry.users for entry in overlapping):
                self.left_out += 1
                return None
            for entry in overlapping:
                self._remove(entry)
            earlier = self._readable.get(extent_id)
            if earlier is not None:
                self._forget(earlier)
            entry = _Entry(extent_id, start, length)
            self._entries.append(entry)
            self._head = end
            view = memoryview(self._memory)[start : start + size]
        return Reservation(self, entry, view)

    def publish(self, entry: _Entry, size: int, identity: FileIdentity) -> None:
        """Make a written extent readable (its writer's use ends)."""
        with self._lock:
            entry.users -= 1
            if entry.dropped or size > entry.length or self._memory is None:
                self._forget(entry)
                return
            entry.size, entry.identity = size, identity
            earlier = self._readable.get(entry.extent_id)
            if earlier is not None and earlier is not entry:
                self._forget(earlier)
            self._readable[entry.extent_id] = entry
            self.kept += 1

    def release(self, entry: _Entry) -> None:
        """One use of ``entry`` (a writer's, a reader's) ended."""
        with self._lock:
            entry.users -= 1
            if entry.dropped or entry.identity is None:  # dropped, or a writer's abort
                self._forget(entry)

    def open(self, extent_id: str, identity_now: Callable[[], FileIdentity]) -> ExtentReader | None:
        """A reader of ``extent_id`` out of the ring, or None when the ring does not hold it or
        its file is no longer the one written (``identity_now`` stats the file)."""
        with self._lock:
            entry = self._readable.get(extent_id)
            if entry is None or self._memory is None:
                return None
            entry.users += 1
            view = memoryview(self._memory)[entry.start : entry.start + entry.size]
        try:
            same_file = identity_now() == entry.identity
        except OSError:
            same_file = False
        if not same_file:  # gone or replaced: read the file, as without the ring
            self.drop(extent_id)
            self.release(entry)
            return None
        with self._lock:
            self.served += 1
        return _RingReader(self, entry, view)

    def drop(self, extent_id: str) -> None:
        """Forget ``extent_id`` (deleted); a reader still open keeps its region until closed."""
        with self._lock:
            entry = self._readable.get(extent_id)
            if entry is not None:
                self._forget(entry)

    def holds(self, extent_id: str) -> bool:
        with self._lock:
            return extent_id in self._readable

    def in_use(self) -> bool:
        """Whether a writer or a reader holds a region of the ring."""
        with self._lock:
            return any(entry.users > 0 for entry in self._entries)

    def reset(self) -> None:
        """Forget every extent and restart the counts, keeping the memory (already resident:
        the ring's next owner pays no page faults). Only for a ring :meth:`in_use` says is
        idle; a region still in use is left alone."""
        with self._lock:
            for entry in list(self._entries):
                self._forget(entry)
            self._head = 0
            self.kept = self.left_out = self.served = 0

    def close(self) -> None:
        """Give the memory back (a view still referenced keeps it until collected)."""
        with self._lock:
            memory, self._memory = self._memory, None
            self._readable.clear()
            self._entries.clear()
        if memory is not None:
            with contextlib.suppress(BufferError):
                memory.close()

    # ---- under the lock -----------------------------------------------------------------------

    def _forget(self, entry: _Entry) -> None:
        """Make ``entry`` unreadable; its region is free once nobody uses it."""
        if self._readable.get(entry.extent_id) is entry:
            del self._readable[entry.extent_id]
        entry.dropped = True
        if entry.users <= 0:
            self._remove(entry)

    def _remove(self, entry: _Entry) -> None:
        if self._readable.get(entry.extent_id) is entry:
            del self._readable[entry.extent_id]
        with contextlib.suppress(ValueError):
            self._entries.remove(entry)


class _RingReader(ExtentReader):
    """An extent read out of the ring: loads decrypt straight out of :meth:`mapped`."""

    def __init__(self, ring: RecentWrites, entry: _Entry, view: memoryview) -> None:
        self._ring = ring
        self._entry: _Entry | None = entry
        self._view: memoryview | None = view
        self._size = len(view)

    @property
    def size(self) -> int:
        return self._size

    def readinto(self, offset: int, buffers: Sequence[Buffer]) -> None:
        view = self._view
        if view is None:
            raise StorageError("extent reader is closed")
        copy_from_view(view, offset, [memoryview(buffer).cast("B") for buffer in buffers])

    def mapped(self, segment_bytes: int = 0) -> memoryview | None:
        return self._view  # memory of the process's own: mapped at any segment size

    def close(self) -> None:
        entry, self._entry, self._view = self._entry, None, None
        if entry is not None:
            self._ring.release(entry)
