"""Which loads are still before their first layer, so that bookkeeping can keep out of their way.

A load's first layer is what a model waits on, and everything before it (the keys, the read
plan, layer 0's reads and decryption) runs on a few cores beside whatever else the process does.
The record of a load's use is an index write transaction handed to the background when the load
closes; loading back to back, it ran beside the next load's plan, whose statements then took
~2 ms longer at 8K and ~2.5 ms longer at 128K tokens (docs/perf.md, "Bookkeeping after the first
layer"). So bookkeeping waits until no load of the cache is before its first layer -- for at
most a bound, so that a steady stream of loads never starves it and its backlog never grows.
"""

from __future__ import annotations

import itertools
import threading
import time


class FirstLayerGate:
    """Holds taken by loads until their first layer is handed over; waits until none is held."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._holds: set[int] = set()
        self._ids = itertools.count()

    def hold(self) -> FirstLayerHold:
        """A load's claim, from its start until :meth:`FirstLayerHold.release` (its first layer
        handed over, or the load failed or closed without one)."""
        with self._changed:
            ident = next(self._ids)
            self._holds.add(ident)
        return FirstLayerHold(self, ident)

    def _release(self, ident: int) -> None:
        with self._changed:
            self._holds.discard(ident)
            if not self._holds:
                self._changed.notify_all()

    @property
    def held(self) -> int:
        """How many loads are before their first layer now."""
        with self._changed:
            return len(self._holds)

    def wait_until_clear(self, deadline: float) -> bool:
        """Block until no load is before its first layer, or until ``deadline`` (a
        ``time.monotonic()`` time); return whether it cleared."""
        with self._changed:
            while self._holds:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)
            return True


class FirstLayerHold:
    """One load's hold on a :class:`FirstLayerGate`; releasing it again does nothing."""

    __slots__ = ("_gate", "_ident")

    def __init__(self, gate: FirstLayerGate, ident: int) -> None:
        self._gate = gate
        self._ident = ident

    def release(self) -> None:
        self._gate._release(self._ident)
