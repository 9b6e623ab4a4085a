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
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

_Buffer = np.ndarray[Any, np.dtype[np.uint8]]

_local = threading.local()

#: How long after a load ended the layers it filled at once still count as the pool's working
#: set (seconds): loads of several lengths taking turns keep each length's layers.
RECENT_LOADS_S = 60.0
#: The most layer sizes the working set remembers (the most recent), so that a trim stays cheap
#: whatever the mix of prompt lengths.
RECENT_SIZES = 64


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
    when a load ends (:meth:`trim`): idle buffers beyond ``max_bytes`` -- or beyond the working
    set of recent loads, if more -- go, oldest first. The working set is the few layers each
    load fills at once, per layer size, for the sizes loaded in the last
    :data:`RECENT_LOADS_S` seconds (at most twice the largest of them): a short load between
    two long ones must not release the long ones' layers, which the next long load would fault
    in again (a 128K-token layer is 151 MB; docs/perf.md).
    """

    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self._clock = clock
        # Per layer size of a recent load: the bytes that load fills at once, and when it ended.
        self._recent: dict[int, tuple[int, float]] = {}
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

    def trim(self, keep: int = 0, layer_bytes: int = 0) -> None:
        """Release idle buffers, oldest first, until those left idle fit ``max_bytes``, or the
        working set if more (called when a load ends): ``keep`` bytes, the layers that load
        fills at once, for its ``layer_bytes``-long layers, and what recent loads of other
        layer sizes kept (see the class docstring)."""
        with self._lock:
            self._collect_returned()
            now = self._clock()
            if keep and layer_bytes:
                self._recent[layer_bytes] = (keep, now)
            recent = sorted(self._recent.items(), key=lambda item: item[1][1])[-RECENT_SIZES:]
            self._recent = {
                size: (kept, at) for size, (kept, at) in recent if now - at <= RECENT_LOADS_S
            }
            kept_recently = [kept for kept, _ in self._recent.values()]
            working_set = min(sum(kept_recently), 2 * max(kept_recently, default=0))
            limit = max(self.max_bytes, keep, working_set)
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
