"""Reusable host buffers: per-thread scratch for the workers, recycled layer buffers for loads.

Touching freshly allocated memory costs page faults (an order of magnitude slower than reused
memory on the development VMs; docs/perf.md), which would dominate sealing or reading a large
prefix.
Each worker thread keeps one buffer, grown to the largest layer it has handled, and reuses it for
every task: ciphertext read for a load, sealed output for a store. A worker runs one task at a
time, so the buffer is never shared.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

import numpy as np
import torch

_Buffer = np.ndarray[Any, np.dtype[np.uint8]]

_local = threading.local()


def thread_buffer(size: int) -> memoryview:
    """This thread's scratch buffer, at least ``size`` bytes long, as a view of exactly ``size``.

    Its contents are unspecified: callers overwrite every byte they use.
    """
    buffer: bytearray | None = getattr(_local, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = bytearray(size)
        _local.buffer = buffer
    return memoryview(buffer)[:size]


class RecyclingPool:
    """Host memory for fresh layer tensors, recycled once callers let go of it.

    Fresh memory costs page faults: the kernel hands out new pages at 1-3 GB/s per thread on
    the development VMs, slower than decrypting into them, so a load into fresh memory runs at a
    fraction of one into memory the process already has (docs/perf.md). A layer handed to a
    caller is a tensor over a memoryview of a view of one of the pool's buffers (the memoryview,
    and ``torch.frombuffer``'s tensors and their views, keep that view alive while they live).
    When the last of them goes, a finalizer gives the buffer back, and a later load reuses it
    instead of faulting in new pages; a buffer still referenced by a caller is never handed out
    again. The pool never holds a reference to a lent buffer's view, so it costs nothing per
    layer callers keep. Buffers are allocated uninitialised: a load decrypts over every byte
    before handing a layer over.

    A caller that keeps whole prefixes (a model's cache) and lets them go between requests gets
    the same memory back for the next request, however large. What no load reuses is released
    when a load ends (:meth:`trim`): idle buffers beyond ``max_bytes`` -- or beyond the few
    layers that load fills at once, if more -- go, oldest first.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._idle: list[_Buffer] = []  # oldest first
        self._lent_bytes = 0  # of buffers lent and not yet back in ``_idle``
        # Buffers given back by finalizers, which run in whichever thread dropped the last
        # reference, possibly one inside this pool's lock: a deque's append needs no lock.
        self._returned: collections.deque[_Buffer] = collections.deque()

    def buffer(self, nbytes: int) -> memoryview:
        """A writable byte view of ``nbytes`` with unspecified contents.

        The view (and any tensor made over it, e.g. by ``torch.frombuffer``) keeps its buffer
        from being handed out again while it lives.
        """
        with self._lock:
            self._collect_returned()
            buffer = self._take_idle(nbytes)
            if buffer is None:
                # Memory the caller never touched: torch's allocator, uninitialised (a
                # bytearray would be zero-filled first, one more pass over memory).
                buffer = torch.empty(nbytes, dtype=torch.uint8).numpy()
            self._lent_bytes += len(buffer)
            lent = buffer[:nbytes]
            finalizer = weakref.finalize(lent, self._returned.append, buffer)
            finalizer.atexit = False
            return memoryview(lent)  # type: ignore[arg-type]

    def _collect_returned(self) -> None:
        while self._returned:
            buffer = self._returned.popleft()
            self._lent_bytes -= len(buffer)
            self._idle.append(buffer)

    def _take_idle(self, nbytes: int) -> _Buffer | None:
        """The smallest idle buffer that fits ``nbytes`` (not over twice as large: a caller
        keeping a short layer must not pin a long one's memory), taken out of the idle list."""
        best = -1
        for index, buffer in enumerate(self._idle):
            size = len(buffer)
            if nbytes <= size <= 2 * nbytes and (best < 0 or size < len(self._idle[best])):
                best = index
                if size == nbytes:
                    break
        return self._idle.pop(best) if best >= 0 else None

    def trim(self, keep: int = 0) -> None:
        """Release idle buffers, oldest first, until those left idle fit ``max_bytes``, or
        ``keep`` bytes if more (called when a load ends)."""
        with self._lock:
            self._collect_returned()
            limit = max(self.max_bytes, keep)
            idle = sum(len(buffer) for buffer in self._idle)
            while idle > limit:
                idle -= len(self._idle.pop(0))

    @property
    def pooled_bytes(self) -> int:
        """Bytes of every buffer the pool has: lent to callers, and idle."""
        with self._lock:
            self._collect_returned()
            return self._lent_bytes + sum(len(buffer) for buffer in self._idle)

    @property
    def idle_bytes(self) -> int:
        """Bytes of the buffers no caller holds any more."""
        with self._lock:
            self._collect_returned()
            return sum(len(buffer) for buffer in self._idle)
