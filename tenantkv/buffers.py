"""Reusable host buffers: per-thread scratch for the workers, recycled layer buffers for loads.

Touching freshly allocated memory costs page faults (an order of magnitude slower than reused
memory on the development VMs; docs/perf.md), which would dominate sealing or reading a large
prefix.
Each worker thread keeps one buffer, grown to the largest layer it has handled, and reuses it for
every task: ciphertext read for a load, sealed output for a store. A worker runs one task at a
time, so the buffer is never shared.
"""

from __future__ import annotations

import sys
import threading

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
    """Host buffers for fresh layer tensors, reused once the caller has let go of them.

    A layer handed to a caller is a tensor over a memoryview of one of these buffers (the view,
    and ``torch.frombuffer``'s tensors and their views, keep the buffer referenced while they
    live). When the caller drops the layer, the pool holds the only reference left, and the
    buffer is reused for a later layer instead of faulting in fresh pages (which costs more than
    decrypting on these machines, and makes glibc keep freed layers around). Buffers still
    referenced by a caller are never handed out again. The pool keeps at most ``max_bytes``;
    beyond that, layers are plain fresh allocations.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._buffers: list[bytearray] = []
        self._bytes = 0

    def buffer(self, nbytes: int) -> memoryview:
        """A writable byte view of ``nbytes`` with unspecified contents.

        The view (and any tensor made over it, e.g. by ``torch.frombuffer``) keeps its buffer
        from being handed out again while it lives.
        """
        with self._lock:
            reused = self._reuse(nbytes)
            if reused is not None:
                return reused
            if self._bytes + nbytes > self.max_bytes:
                self._evict_idle(nbytes)
            if self._bytes + nbytes > self.max_bytes:
                return memoryview(bytearray(nbytes))
            buffer = bytearray(nbytes)
            self._buffers.append(buffer)
            self._bytes += nbytes
            return memoryview(buffer)[:nbytes]

    def _reuse(self, nbytes: int) -> memoryview | None:
        """A view of an idle pooled buffer that fits ``nbytes`` (not over twice as large).

        A helper of its own so that no local variable of the caller still refers to a buffer
        when idle ones are counted for eviction.
        """
        for buffer in self._buffers:
            # References: the list, the loop variable and getrefcount's argument. A caller's
            # view or tensor would add one.
            if sys.getrefcount(buffer) == 3 and nbytes <= len(buffer) <= 2 * nbytes:
                return memoryview(buffer)[:nbytes]
        return None

    def _evict_idle(self, needed: int) -> None:
        """Drop idle buffers (oldest first) until ``needed`` more bytes fit."""
        index = 0
        while index < len(self._buffers) and self._bytes + needed > self.max_bytes:
            if sys.getrefcount(self._buffers[index]) == 2:  # the list and the call's argument
                self._bytes -= len(self._buffers.pop(index))
            else:
                index += 1

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return self._bytes
