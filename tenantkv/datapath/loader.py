"""Layer-wise loads: a pipeline that reads, opens and hands over a cached prefix layer by layer.

::

    worker tasks (one per core, on the cache's loader pool), each with one staging-ring slot
    when it needs one:
        take the next chunk in layer order ─► its ciphertext: a slice of the extent's mapping
           (local files: the page cache's own pages), or else read into the slot (one range
           read) ─► decrypt_into the layer's destination (or into the slot, then copy: MHA
           out=, and CUDA on the load's stream) ─► drop the mapped pages from the process's
           resident set ─► count it done; after a layer's last chunk, wake the caller if it
           waits for that layer ─► take the next chunk
    the caller, waiting for a layer of which chunks are still untaken (mapped, and decrypted
    straight into their destination, so no slot is needed): open them itself, then wait for
    the rest

Decrypting straight out of the mapping makes one pass over memory fewer than reading into a
slot and decrypting from there: loads are bound by memory traffic, not by AES, on the machines
measured (docs/perf.md). A load into fresh CPU layers or MLA ``out=`` buffers then uses no
staging slot at all.

A layer is split into equal chunks of consecutive segments that fit one staging slot. A load runs
``workers`` tasks that pull chunks from the load's own sequence (layer 0, then 1, ...), so while
one task opens a chunk of layer ``l``, another is already reading layer ``l+1``, and the caller
consumes earlier layers. A task keeps its slot from chunk to chunk and takes its next chunk in the
same critical section that counts the last one done: per chunk there is one lock round trip and
no pool task, future or callback: per-chunk pool tasks cost Python time, and the interpreter is
what limits loads on small machines, where decryption barely scales to a second thread (handing
chunks from reader threads to separate decrypt workers was measured slower too; docs/perf.md).
The caller is woken once per layer, and only when it waits for that one.

When the caller is blocked on layer 0, workers are held for it: from the moment layer 0's last
chunk is taken, a worker opens no chunk of a later layer, and one already opening such a chunk
pauses before its next group of ``HANDOVER_SEGMENTS`` segments, until the caller has layer 0
and comes back for another layer (or closes the stream); at most ``FIRST_LAYER_TAIL_S`` until
layer 0 completes, and ``FIRST_LAYER_HANDOVER_S`` after, and not while another load's task waits
for a loader thread (a held worker keeps its thread). With one worker per core busy, a woken
caller otherwise waits for a core (Linux queues it behind a worker pinned there, or a worker
it wakes takes its core back) and then for the GIL, which the workers release and take back
around every segment, winning the race for it again and again -- on a 2-core machine a
sizeable part of a layer's time, on the time to first layer (docs/perf.md has the figures).
Later layers do not pause: there the caller's waits matter less than the load's throughput.

Layer 0 is cut in twice as many chunks (the caller waits on it first; a task that is ahead takes
over part of a delayed one's share), and a task that finds no chunk of it left takes one of
layer 1 (held, as above, while the caller waits; a task leaving and another starting was
measured later to the first layer). Layers stay within ``window`` layers of what the
caller has consumed (``wait_for_layer(i)`` always loads up to ``i``). A task leaves when it may
take nothing more, and whoever makes a chunk takeable again (the caller consuming a layer or
asking for a later one) starts tasks up to ``workers`` again. When other tasks (another load's, the
cache's bookkeeping) wait for the pool's threads, a task queues itself behind them after its
chunk, so concurrent loads share the pool chunk by chunk. The staging ring's fixed size gives
back-pressure across every concurrent load.

A layer is handed over only after every one of its segments opened. On CUDA each layer completes
with an event on the load's own stream, and ``wait_for_layer`` makes the caller's current stream
wait on it without blocking the host on GPU work.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import torch

from ..crypto import ExtentCipher, SealOpenError
from ..errors import (
    CacheClosedError,
    InvalidRequestError,
    LoadError,
    LoadRevokedError,
    SegmentIntegrityError,
)
from ..layout import KVLayout, Layer
from ..prefix import BlockKey
from ..storage import BlockStore, ExtentNotFoundError, ExtentReader, ShortReadError, StorageError
from .extent_format import HEADER_BYTES
from .load_targets import LayerOutput, LoadTarget
from .read_plan import ReadPlan, Run
from .staging import Slot, StagingRing

#: Failure classes of an extent: its bytes failed to open (tampering or corruption: a
#: security event), are gone or shorter than indexed (lost: a miss, not evidence of an
#: attack -- a shared tier evicted them, a disk lost them), or could not be read (I/O).
INTEGRITY, LOST, IO = "integrity", "lost", "io"


class ExtentFailure(Exception):
    """Internal: one extent of a plan could not be read or opened."""

    def __init__(self, extent_id: str, layer: int, cause: Exception, kind: str) -> None:
        super().__init__(f"extent {extent_id} layer {layer}: {cause}")
        assert kind in (INTEGRITY, LOST, IO), f"unknown failure class {kind!r}"
        self.extent_id = extent_id
        self.layer = layer
        self.cause = cause
        self.kind = kind

    @property
    def integrity(self) -> bool:
        return self.kind == INTEGRITY

    @property
    def lost(self) -> bool:
        return self.kind == LOST


class _Cancelled(Exception):
    """Internal: a chunk was skipped because its stream was closed."""


FailureHandler = Callable[[ExtentFailure], None]

#: The longest workers are held for a caller blocked on layer 0 from the moment its last chunk
#: is taken (seconds): that chunk's read and decryption, ~1 ms at 8K DeepSeek-V3 tokens.
FIRST_LAYER_TAIL_S = 0.002
#: The longest workers are held after layer 0 completed for a caller blocked on it (seconds),
#: unless it comes back for another layer sooner: time for it to wake and take the layer
#: (~0.1 ms measured). A caller that goes on to work of its own (an engine copying the layer
#: into its pages) has the workers back after this; held for 2 ms, vLLM's hits took ~2 ms
#: longer (docs/perf.md).
FIRST_LAYER_HANDOVER_S = 0.0005
#: Segments a worker opens between looks at whether a caller woken for layer 0 waits for the
#: GIL (16 segments of 64 DeepSeek-V3 tokens: ~1.2 MB, ~0.1 ms of decryption).
HANDOVER_SEGMENTS = 16
#: Mapped bytes a load has opened are dropped from the process (``ExtentReader.done_with``) once
#: this many have gathered, not chunk by chunk: every drop zaps page-table entries the other
#: loader threads' CPUs may cache, and interrupts them to flush those. Per 8 MiB chunk that
#: cost an 8K-token mapped load ~10% (6.0 against 6.7 GB/s with no drops); in 16 MiB batches
#: 6.2 (docs/perf.md). A load keeps at most this much more mapped than its chunks in flight.
MAPPED_DROP_BYTES = 16 * 1024 * 1024


def open_readers(store: BlockStore, plan: ReadPlan) -> dict[str, ExtentReader]:
    """Open every extent of ``plan`` and check its size and header against the index.

    Raises :class:`ExtentFailure` after closing whatever it opened: *lost* for a missing or
    short extent, *integrity* for one that is longer than indexed or whose header names
    another geometry, *io* for an I/O error.
    """
    readers: dict[str, ExtentReader] = {}
    try:
        for extent in plan.extents:
            geometry = extent.geometry
            try:
                reader = store.open(extent.extent_id)
                readers[extent.extent_id] = reader
                header = bytearray(HEADER_BYTES)
                reader.readinto(0, [header])
            except (ExtentNotFoundError, ShortReadError) as err:
                raise ExtentFailure(extent.extent_id, 0, err, LOST) from err
            except StorageError as err:  # EMFILE, EIO, ...: not evidence of tampering
                raise ExtentFailure(extent.extent_id, 0, err, IO) from err
            if reader.size < geometry.total_bytes:
                short = ShortReadError(
                    f"extent holds {reader.size} of {geometry.total_bytes} indexed bytes"
                )
                raise ExtentFailure(extent.extent_id, 0, short, LOST)
            if reader.size != geometry.total_bytes or not geometry.matches_header(bytes(header)):
                cause = SealOpenError("extent size or header does not match the index")
                raise ExtentFailure(extent.extent_id, 0, cause, INTEGRITY)
    except BaseException:
        for reader in readers.values():
            reader.close()
        raise
    return readers


@dataclass(frozen=True, slots=True)
class Chunk:
    """Consecutive segments of one run that are read and opened together (one staging slot)."""

    run: Run
    first: int  # index into run.block_keys
    count: int

    @property
    def slot(self) -> int:
        return self.run.first_slot + self.first

    @property
    def position(self) -> int:
        return self.run.first_position + self.first


def split_chunks(plan: ReadPlan, max_segments: int, workers: int = 1) -> list[Chunk]:
    """Cut every run of ``plan`` into equal chunks of at most ``max_segments`` segments.

    A run is cut into a multiple of ``workers`` chunks (when it has enough segments), so that
    every worker gets an equal share of a layer and none finishes the layer alone.
    """
    if max_segments < 1:
        raise InvalidRequestError(
            "one segment does not fit a staging slot; open the cache with a larger "
            "staging_slot_bytes"
        )
    chunks: list[Chunk] = []
    for run in plan.runs:
        pieces = -(-run.count // max_segments)
        pieces = min(run.count, -(-pieces // workers) * workers)
        size, extra = divmod(run.count, pieces)
        first = 0
        for piece in range(pieces):
            count = size + (piece < extra)
            chunks.append(Chunk(run, first, count))
            first += count
    return chunks


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, end)`` spans sorted, and those that touch or overlap joined."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


@dataclass(frozen=True, slots=True)
class _Work:
    """A chunk with what opening it needs in every layer, computed once per load."""

    chunk: Chunk
    keys: tuple[BlockKey, ...]  # the block keys of its segments
    size: int  # bytes of ciphertext
    starts: tuple[int, ...]  # destination byte offset of each segment (direct targets)


class LoadStream:
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
        pool: Executor,
        ring: StagingRing,
        window: int,
        workers: int,
        on_failure: FailureHandler,
        on_close: Callable[[LoadStream], None] | None = None,
        keys_exist: Callable[[], bool] | None = None,
        on_first_layer: Callable[[], None] | None = None,
    ) -> None:
        """``keys_exist`` is asked before each layer is handed over; once it says no (the
        tenant was deleted, its key version retired), the load ends with LoadRevokedError.
        ``on_first_layer`` is called once layer 0 was handed over, or at close without it."""
        self.layout = layout
        self._on_close = on_close
        self._on_first_layer = on_first_layer
        self._keys_exist = keys_exist
        self.num_layers = layout.num_layers
        self.num_tokens = plan.num_blocks * target.block_tokens
        self.device = target.device
        self._target = target
        self._readers = readers
        self._pool = pool
        self._ring = ring
        self._window = max(1, window)
        self._on_failure = on_failure
        self._segment_bytes = target.block_tokens * layout.token_bytes
        # Extents the store can map are opened straight out of the page cache; the others are
        # read into the worker's staging slot first (docs/perf.md: one pass over memory fewer).
        segment = self._segment_bytes
        self._mapped = {extent_id: reader.mapped(segment) for extent_id, reader in readers.items()}
        all_mapped = all(view is not None for view in self._mapped.values())
        self._opened_lock = threading.Lock()
        self._opened: dict[str, list[tuple[int, int]]] = {}  # mapped spans not yet dropped
        self._opened_bytes = 0
        sealed = plan.runs[0].extent.geometry.sealed_bytes if plan.runs else 1
        # A worker needs a staging slot for ciphertext it reads, and for plaintext that is
        # copied out afterwards (MHA out=, CUDA: pinned, so the copy to the device is async).
        self._needs_slot = not (all_mapped and target.direct)
        per_segment = 0 if all_mapped else sealed
        if not target.direct:
            per_segment += self._segment_bytes  # the slot also holds the decrypted chunk
        # Mapped chunks into their destination keep the slot-sized cut: a chunk is the unit of
        # scheduling, and fewer, larger ones cost less bookkeeping.
        max_segments = ring.slot_bytes // (per_segment or sealed)
        # Layer 0 is what the model waits on first. Cut finer, a worker that is ahead takes over
        # part of the share of one that is delayed (on 2 cores a thread can wait milliseconds to
        # get the GIL back after a read); later layers keep few large chunks, since every chunk
        # costs a read, a lock round trip and Python bookkeeping.
        self._first_work = self._prepare(split_chunks(plan, max_segments, 2 * workers))
        self._work = self._prepare(split_chunks(plan, max_segments, workers))
        self._num_items = (
            len(self._first_work) + (self.num_layers - 1) * len(self._work) if self._work else 0
        )
        self._workers = max(1, workers)
        self._stream: Any = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a layer completed, failed or closed
        self._cancel = threading.Event()
        # Per layer: chunks still to open, the destination, the CUDA event (all under _lock).
        self._remaining = [len(self._first_work)] + [len(self._work)] * (self.num_layers - 1)
        self._outputs: list[LayerOutput | None] = [None] * self.num_layers
        self._events: list[Any] = [None] * self.num_layers
        self._waiting_for = -1  # the layer the caller is blocked on, if any
        # Clear while a caller blocked on layer 0 is to be left a core (see _hold_workers): from
        # the moment layer 0's last chunk is taken until the caller comes back for another layer,
        # or _hold_deadline (time.monotonic()) passes; set otherwise, from the start.
        self._workers_free = threading.Event()
        self._workers_free.set()
        self._hold_deadline = 0.0
        self._next_item = 0  # the next chunk to hand to a worker, in layer order
        self._demanded = -1  # the caller asked for this layer: load up to it whatever the window
        self._released = 0  # layers before this were handed over by iteration and let go
        self._handed = [False] * self.num_layers
        #: ``time.perf_counter()`` when layer 0 was handed over, and when the latest layer
        #: was first handed over (None before): the cache's metrics read them on close.
        self.first_layer_at: float | None = None
        self.last_handed_at: float | None = None
        self._running = 0  # worker tasks queued or running
        self._busy = 0  # chunks taken by a worker and not yet finished
        self._tasks: list[Future[None]] = []
        self._broken: ExtentFailure | None = None  # first failure: take nothing more
        self._failure_handled = False  # set once _broken was evicted and recorded
        self._failed: LoadError | None = None  # the error raised to the caller
        self._stopped = False  # closed, or the pool shut down: take nothing more
        self._closed = False
        with self._lock:
            if self._num_items == 0:
                self._outputs = [self._target.new_layer(i) for i in range(self.num_layers)]
            self._start_workers()

    def _prepare(self, chunks: list[Chunk]) -> list[_Work]:
        token_bytes = self.layout.token_bytes
        rows = self._target.block_rows
        work: list[_Work] = []
        for chunk in chunks:
            first, end = chunk.position, chunk.position + chunk.count
            # map() with a bound multiply: a generator cost ~0.45 ms per 2,048 blocks (128K tokens)
            starts = tuple(map(token_bytes.__mul__, rows[first:end])) if self._target.direct else ()
            keys = chunk.run.block_keys[chunk.first : chunk.first + chunk.count]
            size = chunk.count * chunk.run.extent.geometry.sealed_bytes
            work.append(_Work(chunk, keys, size, starts))
        return work

    # ---- scheduling (called with self._lock held) ----------------------------------------------

    def _next_layer(self) -> int:
        """The layer of the next chunk to take, or -1 while none may be taken."""
        item = self._next_item
        if item >= self._num_items or self._stopped:
            return -1
        first = len(self._first_work)
        layer = 0 if item < first else 1 + (item - first) // len(self._work)
        if layer > self._demanded:
            if self._broken is not None:
                return -1  # after a failure, only what the caller already asked for
            if layer >= self._released + self._window:
                return -1  # far enough ahead of the caller
        return layer

    def _take(self) -> tuple[int, _Work] | None:
        layer = self._next_layer()
        if layer < 0:
            return None
        item = self._next_item
        self._next_item = item + 1
        self._busy += 1
        if self._next_item == len(self._first_work) and self._waiting_for == 0:
            self._hold_workers(FIRST_LAYER_TAIL_S)  # layer 0's last chunk: the caller is next
        if self._outputs[layer] is None:
            self._outputs[layer] = self._target.new_layer(layer)
        if layer == 0:
            return 0, self._first_work[item]
        return layer, self._work[(item - len(self._first_work)) % len(self._work)]

    def _start_workers(self) -> None:
        """Queue worker tasks until ``workers`` are running, if there are chunks to take."""
        if self._running >= self._workers or self._next_layer() < 0:
            return
        self._tasks = [task for task in self._tasks if not task.done()]
        while self._running < self._workers and self._submit_worker():
            self._running += 1

    def _submit_worker(self) -> bool:
        try:
            self._tasks.append(self._pool.submit(self._run_worker))
        except RuntimeError:  # the cache's pools were shut down under us
            self._stop()
            return False
        return True

    def _hold_workers(self, bound: float) -> None:
        """Have workers pause before their next chunk or group of segments of a later layer,
        for at most ``bound`` seconds from now (under the lock; see the module docstring)."""
        self._workers_free.clear()
        self._hold_deadline = time.monotonic() + bound

    def _pause_for_caller(self) -> None:
        """A worker's pause while workers are held (read without the lock: a stale read costs
        one chunk or group more, or a look at the clock). Not while other tasks (another load's)
        wait for a loader thread: a held worker would keep its thread from them."""
        while not self._workers_free.is_set():
            remaining = self._hold_deadline - time.monotonic()
            if remaining <= 0 or self._backlog():
                return
            self._workers_free.wait(remaining)

    def _stop(self) -> None:
        self._stopped = True
        self._cancel.set()
        self._workers_free.set()
        self._changed.notify_all()

    def _backlog(self) -> bool:
        """Whether other tasks wait for a loader thread (then a worker lets them go first)."""
        queue = getattr(self._pool, "_work_queue", None)  # ThreadPoolExecutor's task queue
        return queue is not None and not queue.empty()

    # ---- workers -------------------------------------------------------------------------------

    def _run_worker(self) -> None:
        """A worker task: take chunks in layer order and open them, keeping one staging slot,
        until none may be taken now (the window is full, or the stream done, broken or closed).
        When other tasks wait for the pool's threads, it queues itself behind them instead."""
        slot: Slot | None = None
        layer = 0
        try:
            with self._lock:
                taken = self._take()
                if taken is None:
                    self._leave(None)
                    return
            while True:
                layer, work = taken
                if layer:
                    # Leave a core to a caller blocked on layer 0 (see the module docstring).
                    self._pause_for_caller()
                if slot is None and self._needs_slot:
                    slot = self._ring.acquire(self._cancel)
                error = self._open_chunk(layer, work, slot)
                with self._lock:
                    failure = self._finish_chunk(layer, error)
                    if failure is None:
                        taken = self._take_next(slot)
                        if taken is None:
                            return
                if failure is not None:
                    self._handle_failure(failure)
                    with self._lock:
                        taken = self._take_next(slot)
                        if taken is None:
                            return
        except BaseException as err:  # pragma: no cover - a bug: break the stream, never hang it
            with self._lock:
                if self._broken is None:
                    cause = err if isinstance(err, Exception) else RuntimeError(repr(err))
                    self._broken = ExtentFailure("?", layer, cause, IO)
                self._failure_handled = True
                self._leave(slot)
            raise

    def _finish_chunk(self, layer: int, error: BaseException | None) -> ExtentFailure | None:
        """Count a taken chunk finished, by a worker or the caller (under the lock).

        Returns the failure to handle (outside the lock), if this chunk broke the stream.
        """
        self._busy -= 1
        failure = None
        if error is None:
            self._chunk_done(layer)
        else:
            failure = self._record_error(error)
        if self._broken is not None:
            self._changed.notify_all()  # a waiter may wait for the last chunk
        return failure

    def _take_next(self, slot: Slot | None) -> tuple[int, _Work] | None:
        """The worker's next chunk; or ``None`` once it has left (under the lock).

        A worker leaves in the same critical section in which it finds nothing to take, so
        whoever later makes a chunk takeable sees it gone and starts another.
        """
        if self._backlog() and self._next_layer() >= 0:
            # Others wait for a loader thread: let them go first, and queue behind them.
            if slot is not None:
                self._ring.release(slot)
            if not self._submit_worker():
                self._running -= 1
            return None
        taken = self._take()
        if taken is None:
            self._leave(slot)
        return taken

    def _leave(self, slot: Slot | None) -> None:
        """A worker task ends: give its slot back (under the lock)."""
        if slot is not None:
            self._ring.release(slot)
        self._running -= 1
        if self._stopped or self._broken is not None:
            self._changed.notify_all()

    def _handle_failure(self, failure: ExtentFailure) -> None:
        """Evict and record at detection, even if the caller never reaches this layer, and
        before any waiter can see the error (a caller's next lookup must already miss)."""
        try:
            self._on_failure(failure)
        finally:
            with self._lock:
                self._failure_handled = True
                self._changed.notify_all()

    def _record_error(self, error: BaseException) -> ExtentFailure | None:
        """The first failure breaks the stream and is returned to be handled (under the lock)."""
        if isinstance(error, _Cancelled) or self._broken is not None:
            return None
        assert isinstance(error, ExtentFailure), "errors are classified before they are recorded"
        self._broken = error
        return error

    def _chunk_done(self, layer: int) -> None:
        """One chunk of ``layer`` is open; the layer is complete after its last (under the lock).
        A caller blocked on it is woken; for layer 0, workers are held for it anew."""
        remaining = self._remaining[layer] - 1
        self._remaining[layer] = remaining
        if remaining:
            return
        if self._stream is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
            self._events[layer] = event
        if layer != self._waiting_for:
            return
        self._changed.notify_all()
        if layer == 0:
            self._hold_workers(FIRST_LAYER_HANDOVER_S)

    def _open_chunk(self, layer: int, work: _Work, slot: Slot | None) -> BaseException | None:
        """Open one chunk into the layer's destination: straight out of the extent's mapping,
        or after reading its ciphertext into ``slot``."""
        # Without a slot (the caller helping) only a mapped chunk decrypted straight into its
        # destination can be opened; a worker is without one only once the load is cancelled.
        if self._cancel.is_set() or (slot is None and self._needs_slot):
            return _Cancelled()
        chunk = work.chunk
        extent = chunk.run.extent
        reader = self._readers[extent.extent_id]
        mapped = self._mapped[extent.extent_id]
        offset = extent.geometry.offset(layer, chunk.slot)
        try:
            if mapped is not None:
                if offset + work.size > len(mapped):  # open_readers checked every size
                    raise ShortReadError("a chunk lies past the end of its mapped extent")
                ciphertext = mapped[offset : offset + work.size]
            else:
                assert slot is not None, "reading a chunk needs a staging slot"
                ciphertext = slot.view[: work.size]
                reader.readinto(offset, [ciphertext])
            if self._cancel.is_set():
                return _Cancelled()
            output = self._outputs[layer]
            assert output is not None, "a layer's destination exists once a chunk is taken"
            # Staged plaintext goes after the ciphertext read into the slot, or at the slot's
            # start when the ciphertext came from a mapping.
            plain_at = 0 if mapped is not None else work.size
            self._open_into_destination(layer, work, output, ciphertext, slot, plain_at)
        except BaseException as err:
            return self._classify(extent.extent_id, layer, err)
        finally:
            if mapped is not None:
                self._done_with_mapped(extent.extent_id, offset, work.size)
        return None

    def _done_with_mapped(self, extent_id: str, offset: int, size: int) -> None:
        """Note a mapped span as opened; drop the gathered spans once there are
        :data:`MAPPED_DROP_BYTES` of them, adjacent ones together."""
        with self._opened_lock:
            self._opened.setdefault(extent_id, []).append((offset, offset + size))
            self._opened_bytes += size
            if self._opened_bytes < MAPPED_DROP_BYTES:
                return
            opened, self._opened, self._opened_bytes = self._opened, {}, 0
        for opened_id, spans in opened.items():
            reader = self._readers.get(opened_id)  # None once a close elsewhere cleared them
            if reader is None:
                continue
            for start, end in _merged(spans):
                reader.done_with(start, end - start)

    def _open_into_destination(
        self,
        layer: int,
        work: _Work,
        output: LayerOutput,
        ciphertext: memoryview,
        slot: Slot | None,
        plain_at: int,
    ) -> None:
        chunk = work.chunk
        extent = chunk.run.extent
        segment = self._segment_bytes
        if output.bytes is not None and self._target.direct:
            out = output.bytes
            outs = [out[start : start + segment] for start in work.starts]
            self._open_segments(extent.cipher, layer, work, ciphertext, outs)
            return
        assert slot is not None, "a staged destination needs a staging slot"
        outs = [
            slot.view[plain_at + j * segment : plain_at + (j + 1) * segment]
            for j in range(chunk.count)
        ]
        self._open_segments(extent.cipher, layer, work, ciphertext, outs)
        plain = slot.tensor[plain_at : plain_at + chunk.count * segment]
        plain = plain.view(-1, self.layout.token_bytes)
        if self._stream is None:
            self._target.place(output, chunk.position, plain)
            return
        with torch.cuda.stream(self._stream):
            self._target.place(output, chunk.position, plain)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(self._stream)
        copied.synchronize()  # the slot is reused once this chunk's copy has finished

    def _open_segments(
        self,
        cipher: ExtentCipher,
        layer: int,
        work: _Work,
        sealed: memoryview,
        outs: list[memoryview],
    ) -> None:
        """Open a chunk's segments into ``outs``, ``HANDOVER_SEGMENTS`` at a time, pausing
        between groups while a caller woken for layer 0 has not run yet.

        Each segment's decryption releases the GIL and takes it back microseconds later, so a
        woken caller that needs the GIL loses the race for it again and again, and the
        interpreter's forced switch never comes (the lock changes hands all the time): on 2
        cores that cost the first layer 0.5-0.9 ms at the median (docs/perf.md). A worker that
        stops taking the GIL for a moment lets the caller have it at once.
        """
        first = work.chunk.slot
        count = len(outs)
        if count <= HANDOVER_SEGMENTS:
            cipher.open_many_into(first, layer, work.keys, sealed, outs)
            return
        stride = len(sealed) // count
        for start in range(0, count, HANDOVER_SEGMENTS):
            if layer:
                self._pause_for_caller()
            end = min(start + HANDOVER_SEGMENTS, count)
            cipher.open_many_into(
                first + start,
                layer,
                work.keys[start:end],
                sealed[start * stride : end * stride],
                outs[start:end],
            )

    @staticmethod
    def _classify(extent_id: str, layer: int, err: BaseException) -> BaseException:
        if isinstance(err, _Cancelled | ExtentFailure):
            return err
        if isinstance(err, SealOpenError):
            return ExtentFailure(extent_id, layer, err, INTEGRITY)
        if isinstance(err, ShortReadError | ExtentNotFoundError):
            return ExtentFailure(extent_id, layer, err, LOST)
        if isinstance(err, RuntimeError) and "shutdown" in str(err):
            return _Cancelled()  # the cache's pools were shut down under us
        if isinstance(err, Exception):  # StorageError (EMFILE, EIO, ...), or a bug
            return ExtentFailure(extent_id, layer, err, IO)
        return _Cancelled()  # KeyboardInterrupt and the like: stop, as if closed

    # ---- consumer side -------------------------------------------------------------------------

    def wait_for_layer(self, index: int) -> Layer:
        """Block until layer ``index`` has been read and opened; return it."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} is out of range (0..{self.num_layers - 1})")
        return self._wait(index, release=False)

    def _wait(self, index: int, *, release: bool) -> Layer:
        """Wait for layer ``index`` and hand it over; with ``release``, forget it after."""
        broken: ExtentFailure | None = None
        first_layer = False
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if self._closed:
                raise CacheClosedError("the load stream is closed")
            if index < self._released:
                raise InvalidRequestError(
                    f"layer {index} was already handed over by iteration and released"
                )
            if index and not self._workers_free.is_set():
                self._workers_free.set()  # back for a later layer: workers held for it go on
            if index > self._demanded:
                self._demanded = index
                self._start_workers()
            while self._remaining[index]:
                if self._failed is not None:
                    raise self._failed
                if self._stopped:
                    raise CacheClosedError("the load stream was closed while waiting")
                if (
                    self._broken is not None
                    and self._failure_handled
                    and self._busy == 0
                    and self._next_layer() < 0
                ):
                    broken = self._broken  # every chunk taken has finished: nothing more comes
                    break
                if self._help_with(index):
                    continue
                if index == 0 and self._next_item >= len(self._first_work):
                    # Layer 0's chunks are all taken: this caller is next.
                    self._hold_workers(FIRST_LAYER_TAIL_S)
                self._waiting_for = index
                self._changed.wait()
                self._waiting_for = -1
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
                    self._released = index + 1
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
        if self._needs_slot or self._broken is not None or self._next_layer() != index:
            return False
        taken = self._take()
        if taken is None:
            return False
        layer, work = taken
        self._lock.release()
        try:
            error = self._open_chunk(layer, work, None)
        finally:
            self._lock.acquire()
        failure = self._finish_chunk(layer, error)
        if failure is not None:
            self._lock.release()
            try:
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
        for index in range(self._released, self.num_layers):
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
                    self._running -= 1
        with self._lock:
            while self._running > 0:
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
        for reader in self._readers.values():
            with contextlib.suppress(StorageError, OSError):
                reader.close()
        self._readers.clear()

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
