"""Layer-wise loads: the stream a caller reads a cached prefix from, layer by layer.

::

    worker tasks (load_workers.py), on the cache's loader pool:
        take the next chunk in layer order (schedule.py) ─► read and open it (chunk_io.py)
        ─► count it done; after a layer's last chunk, wake the caller if it waits for it
    the caller, waiting for a layer of which chunks are still untaken (mapped, and decrypted
    straight into their destination, so no slot is needed): open them itself, then wait for
    the rest

The caller is woken once per layer, and only when it waits for that one. A layer is handed over
only after every one of its segments opened, and after the tenant's keys are found to still
exist. On CUDA each layer completes with an event on the load's own stream, and
``wait_for_layer`` makes the caller's current stream wait on it without blocking the host on GPU
work. The staging ring's fixed size gives back-pressure across every concurrent load.

Workers can hold back for a caller blocked on layer 0 (``worker_hold.py``); that policy is
opt-in (``CacheConfig.hold_workers_for_first_layer``) and off by default.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Self

import torch

from ..errors import (
    CacheClosedError,
    InvalidRequestError,
    LoadError,
    LoadRevokedError,
    SegmentIntegrityError,
)
from ..layout import KVLayout, Layer
from ..storage import ExtentReader, StorageError
from .chunk_io import INTEGRITY, IO, LOST, Chunk, ExtentFailure, open_readers, split_chunks
from .load_pool import LoadPool
from .load_targets import LayerOutput, LoadTarget
from .load_workers import FailureHandler, LoadWorkers
from .read_plan import ReadPlan
from .staging import StagingRing

__all__ = [
    "INTEGRITY",
    "IO",
    "LOST",
    "Chunk",
    "ExtentFailure",
    "FailureHandler",
    "LoadStream",
    "open_readers",
    "split_chunks",
]


class LoadStream(LoadWorkers):
    """An in-order stream of a cached prefix's layers; use as a context manager.

    ``for layer_index, layer in stream`` yields every layer in order. ``wait_for_layer(i)`` blocks
    until layer ``i`` is ready and returns it (on CUDA: makes the current stream wait for it).
    Leaving the ``with`` block (or :meth:`close`) cancels queued reads and waits for running ones,
    so no thread, file handle or staging slot is still used by the stream afterwards.
    """

    def __init__(
        self,
        *,
        plan: ReadPlan,
        layout: KVLayout,
        readers: dict[str, ExtentReader],
        target: LoadTarget,
        pool: LoadPool,
        ring: StagingRing,
        window: int,
        workers: int,
        on_failure: FailureHandler,
        on_close: Callable[[LoadStream], None] | None = None,
        keys_exist: Callable[[], bool] | None = None,
        on_first_layer: Callable[[], None] | None = None,
    ) -> None:
        """``workers``: tasks the load runs at most (no more than ``pool`` has threads).
        ``keys_exist`` is asked before each layer is handed over; once it says no (the
        tenant was deleted, its key version retired), the load ends with LoadRevokedError.
        ``on_first_layer`` is called once layer 0 was handed over, or at close without it."""
        super().__init__(
            plan=plan,
            layout=layout,
            readers=readers,
            target=target,
            pool=pool,
            ring=ring,
            window=window,
            workers=workers,
            on_failure=on_failure,
        )
        self._on_close = on_close
        self._on_first_layer = on_first_layer
        self._keys_exist = keys_exist
        self.num_tokens = plan.num_blocks * target.block_tokens
        self.device = target.device
        self._handed = [False] * self.num_layers  # (lock) per layer: handed over yet
        #: ``time.perf_counter()`` when layer 0 was handed over, and when the latest layer
        #: was first handed over (None before): the cache's metrics read them on close.
        self.first_layer_at: float | None = None
        self.last_handed_at: float | None = None
        self._failed: LoadError | None = None  # (lock) the error raised to the caller
        self._closed = False
        self._begin()

    # ---- the caller's side ---------------------------------------------------------------------

    def wait_for_layer(self, index: int) -> Layer:
        """Block until layer ``index`` has been read and opened; return it."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} is out of range (0..{self.num_layers - 1})")
        return self._wait(index, release=False)

    def _wait(self, index: int, *, release: bool) -> Layer:
        """Wait for layer ``index`` and hand it over; with ``release``, forget it after."""
        broken: ExtentFailure | None = None
        first_layer = False
        schedule = self._schedule
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if self._closed:
                raise CacheClosedError("the load stream is closed")
            if index < schedule.released:
                raise InvalidRequestError(
                    f"layer {index} was already handed over by iteration and released"
                )
            if self._hold is not None and self._hold.ends(index):
                self._end_hold()  # back for a later layer: workers held for it go on
            if schedule.demand(index):
                self._start_workers()
            while not schedule.complete(index):
                if self._failed is not None:
                    raise self._failed
                if schedule.stopped:
                    raise CacheClosedError("the load stream was closed while waiting")
                if schedule.nothing_more_comes():
                    broken = self._failure  # every chunk taken has finished: nothing more comes
                    break
                if self._help_with(index):
                    continue
                if self._hold is not None:
                    self._hold_until(
                        self._hold.before_wait(
                            index=index,
                            first_layer_taken=schedule.first_layer_taken,
                            now=time.monotonic(),
                        )
                    )
                schedule.waiting_for = index
                self._changed.wait()
                schedule.waiting_for = -1
        if broken is None and self._keys_exist is not None and not self._keys_exist():
            raise self._revoke()
        with self._lock:
            if broken is None:
                if self._failed is not None:
                    raise self._failed
                if self._closed:
                    raise CacheClosedError("the load stream was closed while waiting")
                output = self._outputs[index]
                event = self._events[index]
                if not self._handed[index]:
                    self._handed[index] = True
                    self.last_handed_at = time.perf_counter()
                    if index == 0:
                        self.first_layer_at = self.last_handed_at
                        first_layer = True
                if release:
                    # Drop our reference so the caller alone decides the layer's lifetime; the
                    # allocator then reuses its memory for the layers that follow.
                    self._outputs[index] = None
                    self._events[index] = None
                    schedule.consume(index)
                    self._start_workers()
        if broken is not None:
            raise self._fail(broken)
        if first_layer:
            self._first_layer_handed()
        assert output is not None, "a complete layer has its destination"
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for tensor in self._tensors_of(output):
                tensor.record_stream(current)
        return output.result

    def _help_with(self, index: int) -> bool:
        """Open the next chunk of layer ``index`` on the caller's own thread, if one is still
        untaken and needs no staging slot: mapped, and decrypted straight into its destination
        (under the lock, released while opening). On the staged path, a caller reading chunks
        through a scratch buffer of its own was measured slower, to the first layer and in all
        (docs/perf.md).

        The caller waits for this layer anyway: decrypting a share of it beats sleeping, and
        it then needs no wake-up -- which on a busy machine costs the first layer a core and
        the interpreter's lock taken back from the workers (docs/perf.md).
        """
        assert self._lock.locked()
        if self._io.needs_slot or not self._schedule.helpable(index):
            return False
        taken = self._take()
        if taken is None:
            return False
        layer, work, output = taken
        self._lock.release()
        try:
            error, span = self._io.open(layer, work, output, None)
        finally:
            self._lock.acquire()
        failure, batch = self._finish_chunk(layer, error, span)
        if failure is not None or batch is not None:
            self._lock.release()
            try:
                if batch is not None:
                    self._io.drop(batch)
                if failure is not None:
                    self._handle_failure(failure)
            finally:
                self._lock.acquire()
        return True

    @staticmethod
    def _tensors_of(output: LayerOutput) -> list[torch.Tensor]:
        if output.rows is not None:
            return [output.rows]
        assert output.pair is not None, "an output has rows or a (k, v) pair"
        return list(output.pair)

    def __iter__(self) -> Iterator[tuple[int, Layer]]:
        for index in range(self._schedule.released, self.num_layers):
            yield index, self._wait(index, release=True)
        self.close()

    @property
    def delivered_layers(self) -> int:
        """How many layers, from layer 0 without a gap, have been handed to the caller."""
        with self._lock:
            return self._delivered()

    def _delivered(self) -> int:
        count = 0
        while count < self.num_layers and self._handed[count]:
            count += 1
        return count

    def _revoke(self) -> LoadError:
        """End the load: its keys were destroyed while it ran (see ``KeyGuard``)."""
        with self._lock:
            if self._failed is None:
                delivered = self._delivered()
                self._failed = LoadRevokedError(
                    "the tenant was deleted, or a data-key version this load reads was retired, "
                    f"while it ran ({delivered} layers from layer 0 had been delivered)",
                    delivered_layers=delivered,
                )
            error = self._failed
        self.close()
        return error

    def _fail(self, failure: ExtentFailure) -> LoadError:
        with self._lock:
            if self._failed is None:
                delivered = self._delivered()
                if failure.integrity:
                    error: LoadError = SegmentIntegrityError(
                        f"a stored segment of layer {failure.layer} failed to open; the cached "
                        f"prefix was dropped ({delivered} layers from layer 0 had been "
                        "delivered intact)",
                        delivered_layers=delivered,
                    )
                elif failure.lost:
                    error = LoadError(
                        f"the bytes of layer {failure.layer} are gone ({failure.cause}); the "
                        f"cached prefix was dropped ({delivered} layers from layer 0 had been "
                        "delivered intact)",
                        delivered_layers=delivered,
                    )
                else:
                    error = LoadError(
                        f"reading layer {failure.layer} failed: {failure.cause}",
                        delivered_layers=delivered,
                    )
                error.__cause__ = failure.cause
                self._failed = error
            error = self._failed
        self.close()
        return error

    # ---- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel queued reads, wait for running chunks, release file handles. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop()
            tasks, self._tasks = self._tasks, []
        self._ring.wake()
        for task in tasks:
            if task.cancel():  # queued, never started
                with self._lock:
                    self._schedule.task_left()
        with self._lock:
            while self._schedule.running > 0:
                self._changed.wait(timeout=1.0)
            # Let go of layer buffers the caller was never handed.
            self._outputs = [None] * self.num_layers
            self._events = [None] * self.num_layers
        # Layers a load fills at once: the window ahead of the caller, the one being filled, and
        # the one the caller holds.
        self._target.finish(layers_in_flight=self._window + 2)
        self._first_layer_handed()  # if it never was
        if self._on_close is not None:
            self._on_close(self)
        readers = self._io.readers
        for reader in readers.values():
            with contextlib.suppress(StorageError, OSError):
                reader.close()
        readers.clear()

    def _first_layer_handed(self) -> None:
        """Tell ``on_first_layer``, once."""
        notify, self._on_first_layer = self._on_first_layer, None
        if notify is not None:
            notify()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
