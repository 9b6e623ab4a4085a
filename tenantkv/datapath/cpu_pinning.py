"""Worker threads pinned one per CPU, so that a load's (or a store's) workers never queue
behind each other.

A load's workers are woken together (the stream starts them, then each wakes the other when it
releases the interpreter lock). Linux then often queued the second behind the first on one CPU
while the other CPU idled, and it waited there for the first's time slice (EEVDF's base slice
is 3 ms) before it ran: per-thread scheduler statistics of 8K-token loads on a 2-core VM showed
one worker runnable but not running for 2-4 ms before the first layer in most loads, and the
first layer's median at 6.9 ms (max 9.1). With each loader thread pinned to a CPU of its own,
those waits were gone: median 4.6-4.9 ms, max 5.5-5.9 (docs/perf.md, "Loader threads pinned").
Stores seal on a pool of their own, and pinned, its threads stored 8K prefixes 1.12-1.27x as
fast.

Each pool (the loader's, the sealer's) pins its threads round robin over the CPUs the process
may run on when the pool is built (its affinity mask, which honours cgroup cpusets), in the
order the pool starts them. A pool with more threads than those CPUs is left unpinned: which of
its threads takes a task is arbitrary, so two workers of one load could land on threads pinned
to the same CPU and share it while another idles. Pinning is best effort: where the platform
has no ``sched_setaffinity`` or refuses it, the thread runs unpinned and a warning is logged
once. ``CacheConfig.pin_workers=False`` turns it off (where an engine pins its own busy threads
to the same CPUs, say, and the scheduler should be free to move loads and stores away from
them).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading

from ..host_cpus import allowed_cpus

logger = logging.getLogger("tenantkv")

__all__ = ["CpuPinning", "allowed_cpus", "pinning_for_pool"]


def pinning_for_pool(threads: int) -> CpuPinning | None:
    """The pinning of a pool of ``threads`` threads: one CPU each, or None (unpinned) when the
    process may run on fewer CPUs than that (see the module docstring)."""
    pinning = CpuPinning()
    return pinning if 0 < threads <= len(pinning.cpus) else None


class CpuPinning:
    """Pins each thread that calls :meth:`pin_current_thread` to the next CPU, round robin.

    Meant as a thread pool's ``initializer``: it never raises, since an initializer that raises
    breaks the pool."""

    def __init__(self, cpus: list[int] | None = None) -> None:
        self.cpus = allowed_cpus() if cpus is None else list(cpus)
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._warned = False
        #: How many threads were pinned, and how many could not be.
        self.pinned = 0
        self.failed = 0

    def pin_current_thread(self) -> None:
        """Pin the calling thread to the next CPU (a thread of its own while there are CPUs)."""
        setaffinity = getattr(os, "sched_setaffinity", None)
        if not self.cpus or setaffinity is None:
            return
        with self._lock:
            cpu = self.cpus[next(self._next) % len(self.cpus)]
        try:
            setaffinity(0, {cpu})  # 0: the calling thread (Linux sets affinity per thread)
        except (OSError, ValueError) as err:
            with self._lock:
                self.failed += 1
                warn, self._warned = not self._warned, True
            if warn:
                logger.warning(
                    "a worker thread runs unpinned: pinning it to CPU %d failed: %s", cpu, err
                )
            return
        with self._lock:
            self.pinned += 1
