"""Layer-wise loads: read, open and hand over a cached prefix one layer at a time.

A :class:`LoadStream` keeps a bounded window of layers in flight on the cache's worker pool: while
the caller works on layer ``l``, workers read (one range read per run) and open
(``decrypt_into``) layers ``l+1 .. l+window``. Each worker reads ciphertext into its own reused
staging buffer, so no fresh ciphertext memory is touched per load, and decrypts straight into the
layer's output buffer. A layer is only ever handed over after every one of its segments opened.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Executor, Future
from concurrent.futures import wait as wait_futures
from types import TracebackType
from typing import Self

import torch

from .buffers import thread_buffer
from .crypto import SealOpenError
from .errors import CacheClosedError, InvalidRequestError, LoadError, SegmentIntegrityError
from .extent_format import HEADER_BYTES
from .layout import KVLayout, Layer
from .read_plan import ReadPlan
from .storage import BlockStore, ExtentNotFoundError, ExtentReader, ShortReadError, StorageError


class ExtentFailure(Exception):
    """Internal: one extent of a plan could not be read or opened."""

    def __init__(self, extent_id: str, layer: int, cause: Exception, integrity: bool) -> None:
        super().__init__(f"extent {extent_id} layer {layer}: {cause}")
        self.extent_id = extent_id
        self.layer = layer
        self.cause = cause
        self.integrity = integrity


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


class LoadStream:
    """An in-order stream of a cached prefix's layers; use as a context manager.

    ``for layer_index, layer in stream`` yields every layer in order. ``wait_for_layer(i)`` blocks
    until layer ``i`` is ready and returns it. Leaving the ``with`` block (or :meth:`close`) cancels
    what is still queued and waits for running reads, so no thread or file handle outlives it.
    """

    def __init__(
        self,
        *,
        plan: ReadPlan,
        layout: KVLayout,
        readers: dict[str, ExtentReader],
        executor: Executor,
        device: torch.device,
        window: int,
        on_failure: FailureHandler,
    ) -> None:
        self.layout = layout
        self.num_layers = layout.num_layers
        self.num_tokens = plan.num_blocks * 64
        self.device = device
        self._plan = plan
        self._readers = readers
        self._executor = executor
        self._window = max(1, window)
        self._on_failure = on_failure
        self._futures: dict[int, Future[torch.Tensor]] = {}
        self._next_submit = 0
        self._released = 0  # layers before this were handed over by iteration and let go
        self._handed: set[int] = set()
        self._closed = False
        self._failed: LoadError | None = None
        self._lock = threading.Lock()
        self._stage_bytes = plan.largest_run_bytes
        self._segment_bytes = 64 * layout.token_bytes
        self._submit_through(self._window - 1)

    # ---- scheduling ----------------------------------------------------------------------------

    def _submit_through(self, last: int) -> None:
        last = min(last, self.num_layers - 1)
        while self._next_submit <= last:
            layer = self._next_submit
            self._futures[layer] = self._executor.submit(self._read_layer, layer)
            self._next_submit += 1

    def _read_layer(self, layer: int) -> torch.Tensor:
        """Worker: read and open every segment of one layer into a fresh row buffer."""
        pin = self.device.type == "cuda"
        rows = torch.empty(
            (self.num_tokens, self.layout.token_bytes), dtype=torch.uint8, pin_memory=pin
        )
        out = memoryview(rows.numpy()).cast("B")  # type: ignore[arg-type]
        segment = self._segment_bytes
        for run in self._plan.runs:
            extent = run.extent
            sealed = extent.geometry.sealed_bytes
            stage = thread_buffer(run.count * sealed)
            try:
                self._readers[extent.extent_id].readinto(
                    extent.geometry.offset(layer, run.first_slot), [stage]
                )
                for j, key in enumerate(run.block_keys):
                    position = run.first_position + j
                    extent.cipher.open_into(
                        run.first_slot + j,
                        layer,
                        key,
                        stage[j * sealed : (j + 1) * sealed],
                        out[position * segment : (position + 1) * segment],
                    )
            except SealOpenError as err:
                raise ExtentFailure(extent.extent_id, layer, err, integrity=True) from err
            except ShortReadError as err:
                raise ExtentFailure(extent.extent_id, layer, err, integrity=True) from err
            except StorageError as err:
                raise ExtentFailure(extent.extent_id, layer, err, integrity=False) from err
        if pin:
            return rows.to(self.device, non_blocking=False)
        return rows

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
            self._submit_through(index)
            future = self._futures[index]
        try:
            rows = future.result()
        except ExtentFailure as failure:
            raise self._fail(failure) from failure.cause
        except CancelledError:
            raise CacheClosedError("the load stream was closed while waiting") from None
        with self._lock:
            self._handed.add(index)
        return self.layout.layer_from_rows(rows)

    def __iter__(self) -> Iterator[tuple[int, Layer]]:
        for index in range(self._released, self.num_layers):
            layer = self.wait_for_layer(index)
            with self._lock:
                # Drop our reference so the caller alone decides the layer's lifetime; the
                # allocator then reuses its memory for the layers that follow.
                self._futures.pop(index, None)
                self._released = index + 1
                if not self._closed:
                    self._submit_through(index + self._window)
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
        with self._lock:
            first = self._failed is None
            if first:
                self._failed = error
            else:
                error = self._failed  # type: ignore[assignment]
        self.close()
        if first:
            self._on_failure(failure)
        return error

    # ---- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel queued layers, wait for running ones, release file handles. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            futures = list(self._futures.values())
            self._futures.clear()
        for future in futures:
            future.cancel()
        wait_futures(futures)
        for reader in self._readers.values():
            with contextlib.suppress(StorageError, OSError):
                reader.close()
        self._readers.clear()

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
