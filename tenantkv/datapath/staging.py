"""The staging ring: a fixed set of reusable host buffers shared by every load of a cache.

A load's worker takes a slot, reads a chunk of ciphertext into it, opens it into the chunk's
destination, and keeps the slot for its next chunk; it gives the slot back when it stops. The
ring bounds the bytes in flight for all loads together: when every slot is taken, workers wait
(back-pressure) instead of allocating, so host memory stays flat whatever the prefix size or the
number of concurrent loads. Slots are allocated once and reused; for CUDA targets they are
pinned, so host-to-device copies run asynchronously on the load's stream.

A slot's bytes are never handed to a caller: callers receive their own output buffers, and a
chunk copies out exactly the plaintext it decrypted for its request, so no stale tail of another
tenant's load can leak.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..config import CacheConfig

# The defaults live in CacheConfig (its field defaults, read off the class).
DEFAULT_RING_BYTES: int = CacheConfig.staging_bytes
DEFAULT_SLOT_BYTES: int = CacheConfig.staging_slot_bytes


@dataclass(eq=False)
class Slot:
    """One staging buffer: a uint8 tensor and a writable view of its bytes."""

    index: int
    tensor: torch.Tensor
    view: memoryview


@dataclass(frozen=True)
class RingStats:
    slots: int
    slot_bytes: int
    in_use: int
    peak_in_use: int
    waits: int


class StagingRing:
    """A fixed pool of ``ring_bytes // slot_bytes`` slots of ``slot_bytes`` each."""

    def __init__(self, ring_bytes: int, slot_bytes: int, *, pinned: bool = False) -> None:
        if slot_bytes <= 0 or ring_bytes < slot_bytes:
            raise ValueError(
                f"the staging ring ({ring_bytes} B) must hold at least one slot ({slot_bytes} B)"
            )
        self.slot_bytes = slot_bytes
        self.pinned = pinned
        self.num_slots = ring_bytes // slot_bytes
        self._free: list[Slot] = []
        self._allocated = 0
        self._in_use = 0
        self._peak = 0
        self._waits = 0
        self._condition = threading.Condition()

    def _new_slot(self) -> Slot:
        tensor = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        view = memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]
        self._allocated += 1
        return Slot(self._allocated - 1, tensor, view)

    def acquire(self, cancelled: threading.Event) -> Slot | None:
        """Take a free slot, waiting while none is free; ``None`` if ``cancelled`` is set first.

        Slots are allocated lazily, up to the ring's size, so an idle cache holds no staging.
        """
        with self._condition:
            waited = False
            while True:
                if cancelled.is_set():
                    return None
                if self._free:
                    slot = self._free.pop()
                    break
                if self._allocated < self.num_slots:
                    slot = self._new_slot()
                    break
                if not waited:
                    self._waits += 1
                    waited = True
                self._condition.wait(timeout=0.05)
            self._in_use += 1
            self._peak = max(self._peak, self._in_use)
            return slot

    def release(self, slot: Slot) -> None:
        with self._condition:
            self._free.append(slot)
            self._in_use -= 1
            self._condition.notify()

    def wake(self) -> None:
        """Wake every waiter so that cancelled loads stop waiting at once."""
        with self._condition:
            self._condition.notify_all()

    def stats(self) -> RingStats:
        with self._condition:
            return RingStats(self.num_slots, self.slot_bytes, self._in_use, self._peak, self._waits)
