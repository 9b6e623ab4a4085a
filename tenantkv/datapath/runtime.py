"""The runtime of one open cache: thread pools, staging rings, buffer pools, open streams.

Built once by ``tenantkv.open`` and shared by every service. Stores seal on their own pool and
loads read on theirs, so a large store never delays a load's first layer; bookkeeping after a
load (a batch of records of use, ``use_records.py``) runs on a bookkeeping thread of its own,
once no load is before its first layer (``first_layers.py``). Closing stops everything in
order: open streams first (their chunks must finish before the pools go away), then the pools.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..config import CacheConfig
from ..errors import CacheClosedError
from ..openmp_threads import pool_initializer
from .buffers import RecyclingPool
from .cpu_pinning import CpuPinning, pinning_for_pool
from .first_layers import FirstLayerGate
from .load_pool import LoadPool
from .loader import LoadStream
from .staging import RingStats, StagingRing
from .worker_hold import FirstLayerHold

#: Bookkeeping starts no sooner than this after it was handed over. A load that follows the one
#: that handed it over has taken its hold on the first-layer gate by then, and the batch of
#: records of use it writes holds every load of that quarter second: one write transaction per
#: tenant for all of them, not one per load. Each write is 1-2 ms of CPU, most of it Python that
#: holds the interpreter beside the caller's own work: an engine's next forward step, which it
#: slowed by more than its own time (vLLM on CPU, a later turn's hit every 25-35 ms: 0.92-1.00x
#: the time with a write per load at a 20 ms delay, ``bench/vllm_hit_phases.py``; docs/perf.md,
#: "vLLM: where a later turn's time goes"). Records of use drive retention and LRU eviction,
#: which count in seconds and longer; a quarter second more before they reach the index changes
#: neither.
BOOKKEEPING_DELAY_S = 0.25
#: ... and waits for loads before their first layer at most this long after it was handed over.
BOOKKEEPING_HOLD_S = 0.75


class Runtime:
    """Executors, rings, pools and the registry of open streams of one cache."""

    def __init__(self, config: CacheConfig) -> None:
        self.workers = config.seal_threads
        # Layers a load keeps ready ahead of its caller (and a store seals ahead of its writes):
        # the next layers arrive while the caller works on one, and memory stays bounded.
        self.window = config.read_ahead
        self.load_threads = config.load_threads
        # Each worker thread on a CPU of its own (cpu_pinning.py: otherwise a load's or a
        # store's workers queued behind each other on one CPU, for milliseconds).
        pin, claims = config.pin_workers, config.cpu_claim_dir
        self.seal_pinning = pinning_for_pool(self.workers, claims) if pin else None
        self.load_pinning = pinning_for_pool(self.load_threads, claims) if pin else None
        self.seal_executor = _pool(self.workers, "tenantkv-seal", self.seal_pinning)
        # Loads run as many workers as this pool has threads; it counts the tasks that wait
        # for a thread, so that a load's workers let other loads' tasks go first.
        self.load_executor = LoadPool(
            self.load_threads,
            "tenantkv-load",
            _initializer(self.load_pinning),
            # Opt-in (worker_hold.py: measured to help on 2-core machines only, and little).
            first_layer_hold=FirstLayerHold() if config.hold_workers_for_first_layer else None,
        )
        # One thread: bookkeeping that waits for a first layer never holds a load's worker;
        # it keeps up with many small loads because each task writes a batch of them.
        self.bookkeeping_executor = ThreadPoolExecutor(
            1, thread_name_prefix="tenantkv-books", initializer=pool_initializer()
        )
        #: Loads before their first layer; bookkeeping waits for them (first_layers.py).
        self.first_layers = FirstLayerGate()
        self._closing = threading.Event()
        self._ring_config = (config.staging_bytes, config.staging_slot_bytes)
        self._rings = {False: StagingRing(*self._ring_config)}
        # Host memory for fresh CPU layers, recycled once callers drop them (see buffers.py).
        self.layer_pool = RecyclingPool(max_bytes=config.layer_pool_bytes)
        self._streams: weakref.WeakSet[LoadStream] = weakref.WeakSet()
        self._closed = False
        self._lock = threading.Lock()

    @property
    def staging_bytes(self) -> int:
        return self._ring_config[0]

    def check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("the cache is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def staging_ring(self, *, pinned: bool) -> StagingRing:
        """The ring shared by all loads (a pinned one, made on first use, for CUDA targets)."""
        with self._lock:
            ring = self._rings.get(pinned)
            if ring is None:
                ring = self._rings[pinned] = StagingRing(*self._ring_config, pinned=pinned)
            return ring

    def staging_stats(self) -> dict[str, RingStats]:
        """Slots, slots in use, peak use and back-pressure waits of each staging ring."""
        with self._lock:
            rings = dict(self._rings)
        return {("pinned" if pinned else "host"): ring.stats() for pinned, ring in rings.items()}

    def submit_background(self, task: Callable[..., object], *args: object) -> None:
        """Run bookkeeping (a batch of loads' records of use) on the bookkeeping thread, at least
        ``BOOKKEEPING_DELAY_S`` later and once no load is before its first layer (waiting at
        most until ``BOOKKEEPING_HOLD_S`` after now). Once the cache closes, what has not
        started is dropped (never raised), and what waits runs at once."""
        submitted = time.monotonic()
        with contextlib.suppress(RuntimeError):
            self.bookkeeping_executor.submit(self._after_first_layers, submitted, task, args)

    def _after_first_layers(
        self, submitted: float, task: Callable[..., object], args: tuple[object, ...]
    ) -> None:
        # Once the cache closes, its streams are closed: nothing to wait for.
        if not self._closing.wait(max(0.0, submitted + BOOKKEEPING_DELAY_S - time.monotonic())):
            self.first_layers.wait_until_clear(submitted + BOOKKEEPING_HOLD_S)
        task(*args)

    def track_stream(self, stream: LoadStream) -> None:
        """Keep ``stream`` to close with the cache; a stream that arrives once the cache is
        closing (its close took the list already) is closed here, and the load refused."""
        with self._lock:
            if not self._closed:
                self._streams.add(stream)
                return
        stream.close()
        raise CacheClosedError("the cache is closed")

    def begin_close(self) -> list[LoadStream]:
        """Mark the runtime closed; return the streams still open (None if already closed)."""
        with self._lock:
            if self._closed:
                return []
            self._closed = True
            self._closing.set()
            return list(self._streams)

    def shutdown(self, *, wait: bool = True) -> None:
        self.load_executor.shutdown(wait=wait, cancel_futures=True)
        self.bookkeeping_executor.shutdown(wait=wait, cancel_futures=True)
        self.seal_executor.shutdown(wait=wait, cancel_futures=True)
        for pinning in (self.load_pinning, self.seal_pinning):
            if pinning is not None:  # the CPUs claimed for the pools, free for other processes
                pinning.release()


def _pool(threads: int, name: str, pinning: CpuPinning | None) -> ThreadPoolExecutor:
    """A pool of ``threads`` named ``name``, each pinned by ``pinning`` as it starts (if any)."""
    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=_initializer(pinning))


def _initializer(pinning: CpuPinning | None) -> Callable[[], None]:
    """Each pool thread runs torch's kernels on itself alone (``openmp_threads.py``: no OpenMP
    team beside the model's), then takes its CPU (if pinned)."""
    return pool_initializer(pinning.pin_current_thread if pinning is not None else None)
