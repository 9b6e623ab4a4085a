"""The workers' side of a load: one lock, the schedule, and the tasks that open chunks.

::

    worker tasks (up to the load's ``workers``, on the cache's loader pool), each with one
    staging-ring slot when it needs one:
        take the next chunk (schedule.py) ─► read and open it into its layer's destination
        (chunk_io.py) ─► count it done; after a layer's last chunk, wake the caller if it
        waits for that layer ─► take the next chunk (in the same critical section)

:class:`LoadWorkers` owns all synchronisation of a load: one lock, under which it asks the
schedule (a plain state machine, ``schedule.py``) what to do, two conditions on that lock (a
layer completed, failed or closed; a hold on the workers ended), and the event that ends a
closed load's waits for staging slots and its chunk I/O. Chunk I/O runs outside the lock.
Methods that run under the lock assert that it is held. :class:`~.loader.LoadStream` adds the
caller's side.

A load into the caller's own buffers (``out=``) has no window: its workers open every layer
without waiting for the caller, each a layer of its own (:func:`load_window`,
:func:`later_layer_shares`).

With the opt-in hold (``worker_hold.py``), workers pause before (groups of segments of) later
layers' chunks while the policy says so; without it (the default) nothing here waits for the
caller.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..layout import KVLayout
from ..storage import ExtentReader
from .chunk_io import (
    IO,
    Cancelled,
    ChunkOpener,
    ExtentFailure,
    MappedSpans,
    Span,
    SpanBatch,
    Work,
    split_chunks,
)
from .load_pool import LoadPool
from .load_targets import LayerOutput, LoadTarget
from .read_plan import ReadPlan
from .schedule import Schedule
from .staging import Slot, StagingRing

FailureHandler = Callable[[ExtentFailure], None]

#: A chunk handed out: its layer, what opening it needs, and the layer's destination.
Taken = tuple[int, Work, LayerOutput]


def load_window(target: LoadTarget, num_layers: int, window: int) -> int:
    """Layers a load may open ahead of what its caller consumed.

    ``window`` bounds the memory of fresh layers allocated ahead of the caller. A load into the
    caller's own buffers (``out=``) allocates none, so its workers go on through every layer
    without waiting for the caller to consume one: a worker that finds the window full leaves
    its thread and is started again once the caller moves on, a round trip through the pool per
    layer (docs/perf.md, "Whole layers per worker"). Fairness does not rest on the window: a
    worker gives its thread to other tasks waiting for the pool after each chunk.
    """
    return num_layers if target.out is not None else max(1, window)


def later_layer_shares(window: int, num_layers: int, workers: int) -> int:
    """How many chunks (at least) each layer after the first is cut into.

    Where the window spans every layer, workers open layers of their own, each in chunks as
    large as a staging slot allows rather than in one share per worker: up to ``workers`` times
    fewer chunks, each a read, a lock round trip and Python bookkeeping (docs/perf.md, "Whole
    layers per worker"). Otherwise every worker takes an equal share of each layer, so that
    none finishes a layer alone while the window holds the others back.
    """
    return 1 if window >= num_layers else workers


class LoadWorkers:
    """The chunks of one load, opened by worker tasks in layer order (see the module docstring).

    ``workers``: tasks the load runs at most (no more than ``pool`` has threads).
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
    ) -> None:
        self.layout = layout
        self.num_layers = layout.num_layers
        self._target = target
        self._pool = pool
        self._ring = ring
        self._window = load_window(target, layout.num_layers, window)
        self._on_failure = on_failure
        # The one lock; everything below marked "(lock)" is read and written under it.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a layer completed, failed or closed
        self._free = threading.Condition(self._lock)  # a hold on the workers ended
        self._cancel = threading.Event()  # set at close: the ring's waits and chunk I/O end
        self._io = ChunkOpener(
            layout=layout, readers=readers, target=target, cancelled=self._cancel
        )
        workers = max(1, min(workers, pool.threads))
        max_segments = self._io.max_segments(plan, ring.slot_bytes)
        # Layer 0 is what the model waits on first. Cut finer, a worker that is ahead takes over
        # part of the share of one that is delayed (on 2 cores a thread can wait milliseconds to
        # get the GIL back after a read); later layers keep few large chunks, since every chunk
        # costs a read, a lock round trip and Python bookkeeping.
        self._first_work = self._io.prepare(split_chunks(plan, max_segments, 2 * workers))
        shares = later_layer_shares(self._window, self.num_layers, workers)
        self._work = self._io.prepare(split_chunks(plan, max_segments, shares))
        self._schedule = Schedule(  # (lock)
            num_layers=self.num_layers,
            first_chunks=len(self._first_work),
            chunks=len(self._work),
            window=self._window,
            workers=workers,
        )
        self._spans = MappedSpans()  # (lock)
        # The opt-in hold (worker_hold.py): its deadline while workers are held, else None
        # (lock; workers read it without the lock first: a stale read costs a look more).
        self._hold = pool.first_layer_hold
        self._held_until: float | None = None
        self._group = self._hold.segments if self._hold is not None else 0
        # Per layer (lock): the destination, and on CUDA the event its copies complete with.
        self._outputs: list[LayerOutput | None] = [None] * self.num_layers
        self._events: list[Any] = [None] * self.num_layers
        self._tasks: list[Future[None]] = []  # (lock)
        self._failure: ExtentFailure | None = None  # (lock) the first failure

    def _begin(self) -> None:
        """Start the load: its first worker tasks (or, with nothing to read, its layers)."""
        with self._lock:
            if self._schedule.total == 0:
                self._outputs = [self._target.new_layer(i) for i in range(self.num_layers)]
            self._start_workers()

    # ---- driving the schedule (under the lock) -------------------------------------------------

    def _take(self) -> Taken | None:
        assert self._lock.locked()
        schedule = self._schedule
        taken = schedule.take()
        if taken is None:
            return None
        layer, index = taken
        if self._hold is not None:
            self._hold_until(
                self._hold.after_take(
                    layer=layer,
                    index=index,
                    first_chunks=schedule.first_chunks,
                    waiting_for=schedule.waiting_for,
                    now=time.monotonic(),
                )
            )
        output = self._outputs[layer]
        if output is None:
            try:
                output = self._outputs[layer] = self._target.new_layer(layer)
            except BaseException:  # out of memory, say: the chunk is given back, not held
                schedule.chunk_dropped(failed=False)
                raise
        work = self._first_work[index] if layer == 0 else self._work[index]
        return layer, work, output

    def _start_workers(self) -> None:
        """Queue worker tasks until the schedule's ``workers`` run, if there are chunks to take."""
        assert self._lock.locked()
        wanted = self._schedule.tasks_to_start()
        if not wanted:
            return
        # Cancelled tasks stay listed (a shutdown of the pool cancels them): close() counts
        # them as left, which they never will by themselves.
        self._tasks = [task for task in self._tasks if not task.done() or task.cancelled()]
        for _ in range(wanted):
            if not self._submit_worker():
                return
            self._schedule.task_started()

    def _submit_worker(self) -> bool:
        try:
            self._tasks.append(self._pool.submit(self._run_worker))
        except RuntimeError:  # the cache's pools were shut down under us
            self._stop()
            return False
        return True

    def _stop(self) -> None:
        assert self._lock.locked()
        self._schedule.stop()
        self._cancel.set()
        self._end_hold()
        self._changed.notify_all()

    def _finish_chunk(
        self, layer: int, error: BaseException | None, span: Span | None
    ) -> tuple[ExtentFailure | None, SpanBatch | None]:
        """Count a taken chunk finished, by a worker or the caller. Returns the failure to
        handle and the mapped spans to drop (both outside the lock), if any."""
        assert self._lock.locked()
        schedule = self._schedule
        failure = None
        if error is None:
            if schedule.chunk_done(layer):
                self._layer_complete(layer)
        else:
            assert isinstance(error, Cancelled | ExtentFailure), "errors are classified first"
            failure = error if isinstance(error, ExtentFailure) else None
            if schedule.chunk_dropped(failed=failure is not None):
                self._failure = failure
            else:
                failure = None
            if isinstance(error, Cancelled) and not schedule.stopped:
                # Cancelled from outside the stream (the interpreter or the pool shutting
                # down): the chunk's layer can never complete, so nothing more is taken.
                self._stop()
        if schedule.broken:
            self._changed.notify_all()  # a waiter may wait for the last chunk
        batch = self._spans.add(span) if span is not None else None
        return failure, batch

    def _layer_complete(self, layer: int) -> None:
        """Its last chunk is open: a caller blocked on it is woken."""
        assert self._lock.locked()
        self._events[layer] = self._io.layer_event()
        waiting_for = self._schedule.waiting_for
        if layer != waiting_for:
            return
        self._changed.notify_all()
        if self._hold is not None:
            self._hold_until(
                self._hold.after_complete(
                    layer=layer, waiting_for=waiting_for, now=time.monotonic()
                )
            )

    def _take_next(self, slot: Slot | None) -> Taken | None:
        """The worker's next chunk; or ``None`` once it has left.

        A worker leaves in the same critical section in which it finds nothing to take, so
        whoever later makes a chunk takeable sees it gone and starts another.
        """
        assert self._lock.locked()
        if self._schedule.must_yield(self._pool.waiting()):
            # Others wait for a loader thread: let them go first, and queue behind them.
            if slot is not None:
                self._ring.release(slot)
            if not self._submit_worker():
                self._schedule.task_left()
            return None
        taken = self._take()
        if taken is None:
            self._leave(slot)
        return taken

    def _leave(self, slot: Slot | None) -> None:
        """A worker task ends: give its slot back."""
        assert self._lock.locked()
        if slot is not None:
            self._ring.release(slot)
        if self._schedule.task_left():
            self._changed.notify_all()

    # ---- the opt-in hold (worker_hold.py) ------------------------------------------------------

    def _hold_until(self, deadline: float | None) -> None:
        assert self._lock.locked()
        if deadline is not None:
            self._held_until = deadline

    def _end_hold(self) -> None:
        assert self._lock.locked()
        if self._held_until is not None:
            self._held_until = None
            self._free.notify_all()

    def _pause_for_caller(self, layer: int) -> None:
        """Before (a group of segments of) a chunk of ``layer``: wait while the hold says so."""
        hold = self._hold
        if hold is None:
            return
        now = time.monotonic()
        if hold.pause_s(layer=layer, held_until=self._held_until, now=now, waiting_tasks=0) <= 0:
            return  # the usual case, without the lock
        with self._lock:
            while True:
                pause = hold.pause_s(
                    layer=layer,
                    held_until=self._held_until,
                    now=time.monotonic(),
                    waiting_tasks=self._pool.waiting(),
                )
                if pause <= 0:
                    return
                self._free.wait(pause)

    # ---- workers -------------------------------------------------------------------------------

    def _run_worker(self) -> None:
        """A worker task: take chunks in layer order and open them, keeping one staging slot,
        until none may be taken now (the window is full, or the stream done, broken or closed).
        When other tasks wait for the pool's threads, it queues itself behind them instead."""
        slot: Slot | None = None
        layer = 0
        holding = False  # a taken chunk not yet counted done or dropped
        pause = self._pause_for_caller if self._hold is not None else None
        try:
            with self._lock:
                taken = self._take()
                if taken is None:
                    self._leave(None)
                    return
            while True:
                holding = True
                layer, work, output = taken
                if pause is not None and layer:
                    pause(layer)
                if slot is None and self._io.needs_slot:
                    slot = self._ring.acquire(self._cancel)
                error, span = self._io.open(
                    layer, work, output, slot, group=self._group, pause=pause
                )
                with self._lock:
                    holding = False
                    failure, batch = self._finish_chunk(layer, error, span)
                    if failure is None and batch is None:
                        taken = self._take_next(slot)
                        if taken is None:
                            return
                        continue
                if batch is not None:
                    self._io.drop(batch)
                if failure is not None:
                    self._handle_failure(failure)
                with self._lock:
                    taken = self._take_next(slot)
                    if taken is None:
                        return
        except BaseException as err:  # pragma: no cover - a bug: break the stream, never hang it
            with self._lock:
                if self._failure is None:
                    cause = err if isinstance(err, Exception) else RuntimeError(repr(err))
                    self._failure = ExtentFailure("?", layer, cause, IO)
                if holding:  # its chunk will never finish: the caller must not wait for it
                    self._schedule.chunk_dropped(failed=False)
                self._schedule.fail()
                self._schedule.failure_handled = True
                self._leave(slot)
            raise

    def _handle_failure(self, failure: ExtentFailure) -> None:
        """Evict and record at detection, even if the caller never reaches this layer, and
        before any waiter can see the error (a caller's next lookup must already miss)."""
        try:
            self._on_failure(failure)
        finally:
            with self._lock:
                self._schedule.failure_handled = True
                self._changed.notify_all()
