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
from typing import Any

import numpy as np
import torch

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
    fraction of one into memory the process already has (docs/perf.md). So the pool tracks every
    buffer it hands out. A layer handed to a caller is a tensor over a memoryview of one of them
    (the view, and ``torch.frombuffer``'s tensors and their views, keep the buffer referenced
    while they live); once the caller drops the layer, the pool holds the only reference left,
    the buffer is idle, and a later load reuses it instead of faulting in new pages. A buffer
    still referenced by a caller is never handed out again. Buffers are allocated
    uninitialised: a load decrypts over every byte before handing a layer over.

    A caller that keeps whole prefixes (a model's cache) and lets them go between requests gets
    the same memory back for the next request, however large. What no load reuses is released
    when a load ends (:meth:`trim`): idle buffers beyond ``max_bytes`` go, oldest first.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._buffers: list[np.ndarray[Any, np.dtype[np.uint8]]] = []

    def buffer(self, nbytes: int) -> memoryview:
        """A writable byte view of ``nbytes`` with unspecified contents.

        The view (and any tensor made over it, e.g. by ``torch.frombuffer``) keeps its buffer
        from being handed out again while it lives.
        """
        with self._lock:
            reused = self._reuse(nbytes)
            if reused is not None:
                return reused
            # Memory the caller never touched: torch's allocator, uninitialised (a bytearray
            # would be zero-filled first, one more pass over memory).
            buffer = torch.empty(nbytes, dtype=torch.uint8).numpy()
            self._buffers.append(buffer)
            return memoryview(buffer)[:nbytes]  # type: ignore[arg-type]

    def _reuse(self, nbytes: int) -> memoryview | None:
        """A view of the smallest idle pooled buffer that fits ``nbytes`` (not over twice as
        large: a caller keeping a short layer must not pin a long one's memory).

        A helper of its own so that no local variable of the caller still refers to a buffer
        when idle ones are counted.
        """
        best = -1
        for index in range(len(self._buffers)):
            buffer = self._buffers[index]
            # References: the list, the local variable and getrefcount's argument. A caller's
            # view or tensor would add one. (Not ``enumerate``: its reused result tuple would
            # hold one more.)
            size = len(buffer)
            if (
                sys.getrefcount(buffer) == 3
                and nbytes <= size <= 2 * nbytes
                and (best < 0 or size < len(self._buffers[best]))
            ):
                best = index
                if size == nbytes:
                    break
        if best < 0:
            return None
        return memoryview(self._buffers[best])[:nbytes]  # type: ignore[arg-type]

    def trim(self) -> None:
        """Release idle buffers, oldest first, until those left idle fit ``max_bytes``
        (called when a load ends)."""
        with self._lock:
            idle = self._idle_bytes()
            index = 0
            while idle > self.max_bytes and index < len(self._buffers):
                if sys.getrefcount(self._buffers[index]) == 2:  # the list and the argument
                    idle -= len(self._buffers.pop(index))
                else:
                    index += 1

    def _idle_bytes(self) -> int:
        return sum(len(b) for b in self._buffers if sys.getrefcount(b) == 3)

    @property
    def pooled_bytes(self) -> int:
        """Bytes of every buffer the pool tracks: held by callers, and idle."""
        with self._lock:
            return sum(len(buffer) for buffer in self._buffers)

    @property
    def idle_bytes(self) -> int:
        """Bytes of the buffers no caller holds any more."""
        with self._lock:
            return self._idle_bytes()
