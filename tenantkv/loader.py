"""Layer-wise loads: a pipeline that reads, opens and hands over a cached prefix layer by layer.

::

    loader threads: take a staging-ring slot ─► read a chunk of ciphertext into it (one range read)
                    ─► decrypt_into the layer's destination (or into the slot, then copy: MHA
                       out=, and CUDA on the load's stream) ─► give the slot back

A layer is split into equal chunks of consecutive segments that fit one staging slot, and the
chunks of layers ``l .. l+window`` are spread over the loader threads: while one thread opens a
chunk of layer ``l``, another is already reading layer ``l+1``, and the caller consumes earlier
layers. The ring's fixed size gives back-pressure across every concurrent load. (Handing each
chunk from dedicated reader threads to separate decrypt workers was measured ~10% slower on the
2-core development machines -- one extra thread hand-off per chunk -- so a thread that read a
chunk also opens it; more loader threads than cores keep cores busy while a read waits on
storage.) A layer is
handed over only after every one of its segments opened. On CUDA each layer completes with an
event on the load's own stream, and ``wait_for_layer`` makes the caller's current stream wait on
it without blocking the host on GPU work.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import torch

from .crypto import SealOpenError
from .errors import CacheClosedError, InvalidRequestError, LoadError, SegmentIntegrityError
from .extent_format import HEADER_BYTES
from .layout import KVLayout, Layer
from .load_targets import LayerOutput, LoadTarget
from .read_plan import ReadPlan, Run
from .staging import Slot, StagingRing
from .storage import BlockStore, ExtentNotFoundError, ExtentReader, ShortReadError, StorageError


class ExtentFailure(Exception):
    """Internal: one extent of a plan could not be read or opened."""

    def __init__(self, extent_id: str, layer: int, cause: Exception, integrity: bool) -> None:
        super().__init__(f"extent {extent_id} layer {layer}: {cause}")
        self.extent_id = extent_id
        self.layer = layer
        self.cause = cause
        self.integrity = integrity


class _Cancelled(Exception):
    """Internal: a chunk was skipped because its stream was closed."""


FailureHandler = Callable[[ExtentFailure], None]


def open_readers(store: BlockStore, plan: ReadPlan) -> dict[str, ExtentReader]:
    """Open every extent of ``plan`` and check its size and header against the index.

    Raises :class:`ExtentFailure` after closing whatever it opened: an integrity failure for a
    missing, truncated or relabelled extent, a plain one for an I/O error.
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
                raise ExtentFailure(extent.extent_id, 0, err, integrity=True) from err
            except StorageError as err:  # EMFILE, EIO, ...: not evidence of tampering
                raise ExtentFailure(extent.extent_id, 0, err, integrity=False) from err
            if reader.size != geometry.total_bytes or not geometry.matches_header(bytes(header)):
                cause = SealOpenError("extent size or header does not match the index")
                raise ExtentFailure(extent.extent_id, 0, cause, integrity=True)
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


class _LayerState:
    __slots__ = ("done", "error", "event", "output", "remaining")

    def __init__(self, output: LayerOutput, chunks: int) -> None:
        self.output = output
        self.remaining = chunks
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.event: Any = None  # torch.cuda.Event on CUDA targets


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
    ) -> None:
        self.layout = layout
        self._on_close = on_close
        self.num_layers = layout.num_layers
        self.num_tokens = plan.num_blocks * 64
        self.device = target.device
        self._target = target
        self._readers = readers
        self._pool = pool
        self._ring = ring
        self._window = max(1, window)
        self._on_failure = on_failure
        self._segment_bytes = 64 * layout.token_bytes
        per_segment = plan.runs[0].extent.geometry.sealed_bytes if plan.runs else 1
        if not target.direct:
            per_segment += self._segment_bytes  # the slot also holds the decrypted chunk
        max_segments = ring.slot_bytes // per_segment
        self._chunks = split_chunks(plan, max_segments, workers)
        # Layer 0 is what the model waits on first. Cut finer, a worker that is ahead takes over
        # part of the share of one that is delayed (on 2 cores a thread can wait milliseconds to
        # get the GIL back after a read); later layers keep few large chunks, since every chunk
        # costs a task, a slot hand-over and a completion of Python bookkeeping.
        self._first_chunks = split_chunks(plan, max_segments, 2 * workers)
        # Layers being read/opened at once: enough chunks to keep every worker busy, and no
        # more, so that a layer is not slowed by work on layers the caller needs later. Until
        # layer 0 is done it runs alone: the time to the first layer is what the model waits on.
        self._max_in_flight = max(2, -(-workers // len(self._chunks)) + 1) if self._chunks else 1
        self._in_flight = 0
        self._first_done = False
        self._stream: Any = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        # Re-entrant: a future that is already done runs its callback (which takes the lock)
        # inside add_done_callback, and workers schedule new layers from _chunk_finished.
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._cancel = threading.Event()
        self._layers: dict[int, _LayerState] = {}
        self._io_futures: dict[Future[None], int] = {}
        self._outstanding = 0
        self._next_layer = 0
        self._released = 0  # layers before this were handed over by iteration and let go
        self._handed: set[int] = set()
        self._broken: ExtentFailure | None = None  # first failure: schedule nothing more
        self._failure_handled = threading.Event()  # set once _broken was evicted and recorded
        self._failed: LoadError | None = None  # the error raised to the caller
        self._closed = False
        with self._lock:
            self._schedule()

    # ---- scheduling (called with self._lock held) ----------------------------------------------

    def _schedule(self, demanded: int = -1) -> None:
        """Start layers while fewer than ``_max_in_flight`` are in progress and the next one is
        within ``window`` layers of what the caller has consumed; always up to ``demanded``."""
        while self._next_layer < self.num_layers and self._broken is None and not self._closed:
            ahead_ok = self._next_layer < self._released + self._window
            limit = self._max_in_flight if self._first_done else 1
            if self._next_layer > demanded and not (ahead_ok and self._in_flight < limit):
                break
            self._start_layer(self._next_layer)
            self._next_layer += 1

    def _start_layer(self, layer: int) -> None:
        chunks = self._first_chunks if layer == 0 else self._chunks
        state = _LayerState(self._target.new_layer(layer), len(chunks))
        self._layers[layer] = state
        if not chunks:
            state.done.set()
            return
        self._in_flight += 1
        for chunk in chunks:
            self._outstanding += 1
            future = self._pool.submit(self._process_chunk, layer, chunk, state)
            self._io_futures[future] = layer
            future.add_done_callback(self._forget_io_future)

    def _forget_io_future(self, future: Future[None]) -> None:
        with self._lock:
            self._io_futures.pop(future, None)

    # ---- pipeline stages (worker threads) ------------------------------------------------------

    def _process_chunk(self, layer: int, chunk: Chunk, state: _LayerState) -> None:
        """Loader thread: take a staging slot, read the chunk's ciphertext, open it into the
        layer's destination, give the slot back."""
        slot = self._ring.acquire(self._cancel)
        if slot is None:
            self._chunk_finished(layer, state, _Cancelled())
            return
        extent = chunk.run.extent
        error: BaseException | None = None
        try:
            size = chunk.count * extent.geometry.sealed_bytes
            self._readers[extent.extent_id].readinto(
                extent.geometry.offset(layer, chunk.slot), [slot.view[:size]]
            )
            if self._cancel.is_set():
                raise _Cancelled()
            self._open_into_destination(layer, chunk, state.output, slot)
        except BaseException as err:
            error = self._classify(extent.extent_id, layer, err)
        finally:
            self._ring.release(slot)
        self._chunk_finished(layer, state, error)

    def _open_into_destination(
        self, layer: int, chunk: Chunk, output: LayerOutput, slot: Slot
    ) -> None:
        extent = chunk.run.extent
        sealed = extent.geometry.sealed_bytes
        segment = self._segment_bytes
        token_bytes = self.layout.token_bytes
        keys = chunk.run.block_keys
        rows = self._target.block_rows
        chunk_keys = keys[chunk.first : chunk.first + chunk.count]
        ciphertext = slot.view[: chunk.count * sealed]
        if output.bytes is not None and self._target.direct:
            out = output.bytes
            starts = [
                rows[p] * token_bytes for p in range(chunk.position, chunk.position + chunk.count)
            ]
            outs = [out[start : start + segment] for start in starts]
            extent.cipher.open_many_into(chunk.slot, layer, chunk_keys, ciphertext, outs)
            return
        plain_at = chunk.count * sealed
        outs = [
            slot.view[plain_at + j * segment : plain_at + (j + 1) * segment]
            for j in range(chunk.count)
        ]
        extent.cipher.open_many_into(chunk.slot, layer, chunk_keys, ciphertext, outs)
        plain = slot.tensor[plain_at : plain_at + chunk.count * segment].view(-1, token_bytes)
        if self._stream is None:
            self._target.place(output, chunk.position, plain)
            return
        with torch.cuda.stream(self._stream):
            self._target.place(output, chunk.position, plain)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(self._stream)
        copied.synchronize()  # the slot is reused once this chunk's copy has finished

    @staticmethod
    def _classify(extent_id: str, layer: int, err: BaseException) -> BaseException:
        if isinstance(err, _Cancelled | ExtentFailure):
            return err
        if isinstance(err, SealOpenError | ShortReadError | ExtentNotFoundError):
            return ExtentFailure(extent_id, layer, err, integrity=True)
        if isinstance(err, StorageError):
            return ExtentFailure(extent_id, layer, err, integrity=False)
        if isinstance(err, RuntimeError) and "shutdown" in str(err):
            return _Cancelled()  # the cache's pools were shut down under us
        return err

    def _chunk_finished(self, layer: int, state: _LayerState, error: BaseException | None) -> None:
        first_failure: ExtentFailure | None = None
        with self._lock:
            state.remaining -= 1
            if error is not None and state.error is None:
                state.error = error
            if isinstance(error, ExtentFailure) and self._broken is None:
                self._broken = first_failure = error
            layer_done = state.remaining == 0
            if layer_done:
                self._in_flight -= 1
                self._first_done = True
                self._schedule()
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle.notify_all()
        if first_failure is not None:
            # Evict and record at detection, even if the caller never reaches this layer, and
            # before any waiter can see the error (a caller's next lookup must already miss).
            try:
                self._on_failure(first_failure)
            finally:
                self._failure_handled.set()
        if layer_done:
            if state.error is None and self._stream is not None:
                state.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                state.event.record(self._stream)
            state.done.set()

    # ---- consumer side -------------------------------------------------------------------------

    def wait_for_layer(self, index: int) -> Layer:
        """Block until layer ``index`` has been read and opened; return it."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} is out of range (0..{self.num_layers - 1})")
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if self._closed:
                raise CacheClosedError("the load stream is closed")
            if index < self._released:
                raise InvalidRequestError(
                    f"layer {index} was already handed over by iteration and released"
                )
            self._schedule(demanded=index)
            state = self._layers.get(index)
            broken = self._broken
        if state is None:  # never scheduled: an earlier layer failed
            assert broken is not None, "an unscheduled layer implies a failed stream"
            self._failure_handled.wait()
            raise self._fail(broken)
        state.done.wait()
        if state.error is not None:
            if isinstance(state.error, ExtentFailure):
                # Another chunk may have completed the layer while the failure is still being
                # handled; the caller must not see the error before the extent is evicted.
                self._failure_handled.wait()
                raise self._fail(state.error)
            if isinstance(state.error, _Cancelled):
                raise CacheClosedError("the load stream was closed while waiting")
            raise self._fail(ExtentFailure("?", index, state.error, integrity=False))  # type: ignore[arg-type]
        with self._lock:
            if self._failed is not None:
                raise self._failed
            self._handed.add(index)
        if state.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(state.event)
            for tensor in self._tensors_of(state.output):
                tensor.record_stream(current)
        return state.output.result

    @staticmethod
    def _tensors_of(output: LayerOutput) -> list[torch.Tensor]:
        if output.rows is not None:
            return [output.rows]
        assert output.pair is not None, "an output has rows or a (k, v) pair"
        return list(output.pair)

    def __iter__(self) -> Iterator[tuple[int, Layer]]:
        for index in range(self._released, self.num_layers):
            layer = self.wait_for_layer(index)
            with self._lock:
                # Drop our reference so the caller alone decides the layer's lifetime; the
                # allocator then reuses its memory for the layers that follow.
                self._layers.pop(index, None)
                self._released = index + 1
                self._schedule()
            yield index, layer
        self.close()

    @property
    def delivered_layers(self) -> int:
        """How many layers, from layer 0 without a gap, have been handed to the caller."""
        with self._lock:
            count = 0
            while count in self._handed:
                count += 1
            return count

    def _fail(self, failure: ExtentFailure) -> LoadError:
        delivered = self.delivered_layers
        if failure.integrity:
            error: LoadError = SegmentIntegrityError(
                f"a stored segment of layer {failure.layer} failed to open; the cached prefix "
                f"was dropped ({delivered} layers from layer 0 had been delivered intact)",
                delivered_layers=delivered,
            )
        else:
            error = LoadError(
                f"reading layer {failure.layer} failed: {failure.cause}",
                delivered_layers=delivered,
            )
        error.__cause__ = failure.cause
        with self._lock:
            if self._failed is None:
                self._failed = error
            else:
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
            self._cancel.set()
            queued = list(self._io_futures.items())
        self._ring.wake()
        for future, layer in queued:
            if future.cancel():
                state = self._layers_state(layer)
                if state is not None:
                    self._chunk_finished(layer, state, _Cancelled())
                else:  # pragma: no cover - a layer is registered before its chunks are queued
                    with self._lock:
                        self._outstanding -= 1
        with self._idle:
            while self._outstanding > 0:
                self._idle.wait(timeout=1.0)
            states = list(self._layers.values())
        for state in states:
            state.done.set()  # no waiter may block on a layer that will never complete
        with self._lock:
            self._layers.clear()  # let go of layer buffers the caller was never handed
        if self._on_close is not None:
            self._on_close(self)
        for reader in self._readers.values():
            with contextlib.suppress(StorageError, OSError):
                reader.close()
        self._readers.clear()

    def _layers_state(self, layer: int) -> _LayerState | None:
        with self._lock:
            return self._layers.get(layer)

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
