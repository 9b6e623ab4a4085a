"""Per-thread reusable host buffers for the worker pool.

Touching freshly allocated memory costs page faults (measured ~1.4 GB/s on the 2-core development
VMs, against ~60 GB/s for reused memory), which would dominate sealing or reading a large prefix.
Each worker thread keeps one buffer, grown to the largest layer it has handled, and reuses it for
every task: ciphertext read for a load, sealed output for a store. A worker runs one task at a
time, so the buffer is never shared.
"""

from __future__ import annotations

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
