"""Chunk I/O of a load: a layer's segments cut into chunks, each read and opened on its own.

::

    a chunk (consecutive segments of one run of the plan, one staging slot's worth):
        its ciphertext: a slice of the extent's mapping (local files: the page cache's own
        pages), or else read into a staging slot (one range read)
        ─► decrypt_into the layer's destination (or into the slot, then copy: MHA out=, and
           CUDA on the load's stream)
        ─► the mapped span is dropped from the process's resident set, in batches

Decrypting straight out of the mapping makes one pass over memory fewer than reading into a
slot and decrypting from there: loads are bound by memory traffic, not by AES, on the machines
measured (docs/perf.md). A load into fresh CPU layers or MLA ``out=`` buffers then uses no
staging slot at all.

A layer is split into equal chunks of consecutive segments that fit one staging slot; a chunk
is the unit of scheduling (``schedule.py``), and every chunk costs a read, a lock round trip and
Python bookkeeping, so chunks are large. Nothing here locks or waits: the stream
(``loader.py``) decides who opens which chunk, and when.

Failures are classified per extent (:class:`ExtentFailure`): bytes that fail to open are
tampering or corruption (a security event), bytes that are gone or shorter than indexed are
lost (a miss), and anything else is I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..crypto import ExtentCipher, SealOpenError
from ..errors import InvalidRequestError
from ..layout import KVLayout
from ..prefix import BlockKey
from ..storage import BlockStore, ExtentNotFoundError, ExtentReader, ShortReadError, StorageError
from .extent_format import HEADER_BYTES
from .load_targets import LayerOutput, LoadTarget
from .read_plan import ReadPlan, Run
from .staging import Slot

#: Failure classes of an extent: its bytes failed to open (tampering or corruption: a
#: security event), are gone or shorter than indexed (lost: a miss, not evidence of an
#: attack -- a shared tier evicted them, a disk lost them), or could not be read (I/O).
INTEGRITY, LOST, IO = "integrity", "lost", "io"

#: Mapped bytes a load has opened are dropped from the process (``ExtentReader.done_with``) once
#: this many have gathered, not chunk by chunk: every drop zaps page-table entries the other
#: loader threads' CPUs may cache, and interrupts them to flush those. Per 8 MiB chunk that
#: cost an 8K-token mapped load ~10% (6.0 against 6.7 GB/s with no drops); in 16 MiB batches
#: 6.2 (docs/perf.md). A load keeps at most this much more mapped than its chunks in flight.
MAPPED_DROP_BYTES = 16 * 1024 * 1024


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


class Cancelled(Exception):
    """Internal: a chunk was skipped because its stream was closed."""


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


def merged_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, end)`` spans sorted, and those that touch or overlap joined."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


#: A mapped span a chunk was opened from: ``(extent_id, start, end)``.
Span = tuple[str, int, int]
#: Spans to drop together, per extent.
SpanBatch = dict[str, list[tuple[int, int]]]


class MappedSpans:
    """Mapped spans opened and not yet dropped, handed out in batches of at least
    :data:`MAPPED_DROP_BYTES` (plain state: its owner serialises the calls)."""

    def __init__(self) -> None:
        self._threshold = MAPPED_DROP_BYTES
        self._spans: SpanBatch = {}
        self._bytes = 0

    def add(self, span: Span) -> SpanBatch | None:
        """Note ``span`` as opened; return the gathered spans once there are enough to drop."""
        extent_id, start, end = span
        self._spans.setdefault(extent_id, []).append((start, end))
        self._bytes += end - start
        if self._bytes < self._threshold:
            return None
        batch, self._spans, self._bytes = self._spans, {}, 0
        return batch


@dataclass(frozen=True, slots=True)
class Work:
    """A chunk with what opening it needs in every layer, computed once per load."""

    chunk: Chunk
    keys: tuple[BlockKey, ...]  # the block keys of its segments
    size: int  # bytes of ciphertext
    starts: tuple[int, ...]  # destination byte offset of each segment (direct targets)


#: Called by a worker between groups of segments of a layer (see :func:`open_segments`).
Pause = Callable[[int], None]


def open_segments(
    cipher: ExtentCipher,
    layer: int,
    work: Work,
    sealed: memoryview,
    outs: list[memoryview],
    *,
    group: int = 0,
    pause: Pause | None = None,
) -> None:
    """Open a chunk's segments into ``outs``: at once, or ``group`` at a time with
    ``pause(layer)`` before each group of a layer after the first (``worker_hold.py``)."""
    first = work.chunk.slot
    count = len(outs)
    if pause is None or group <= 0 or count <= group:
        cipher.open_many_into(first, layer, work.keys, sealed, outs)
        return
    stride = len(sealed) // count
    for start in range(0, count, group):
        if layer:
            pause(layer)
        end = min(start + group, count)
        cipher.open_many_into(
            first + start,
            layer,
            work.keys[start:end],
            sealed[start * stride : end * stride],
            outs[start:end],
        )


class ChunkOpener:
    """Reads and opens the chunks of one load into their layers' destinations."""

    def __init__(
        self,
        *,
        layout: KVLayout,
        readers: dict[str, ExtentReader],
        target: LoadTarget,
        cancelled: threading.Event,
    ) -> None:
        self.layout = layout
        self.readers = readers
        self._target = target
        self._cancelled = cancelled
        self.segment_bytes = layout.segment_bytes(target.block_tokens)  # stored (coded) bytes
        # Extents the store can map are opened straight out of the page cache; the others are
        # read into the worker's staging slot first (docs/perf.md: one pass over memory fewer).
        segment = self.segment_bytes
        self._mapped = {extent_id: reader.mapped(segment) for extent_id, reader in readers.items()}
        self.all_mapped = all(view is not None for view in self._mapped.values())
        #: A chunk needs a staging slot for ciphertext it reads, and for plaintext that is
        #: copied out afterwards (MHA out=, CUDA: pinned, so the copy to the device is async).
        self.needs_slot = not (self.all_mapped and target.direct)
        self._stream: Any = None
        if target.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=target.device)  # type: ignore[no-untyped-call]

    def max_segments(self, plan: ReadPlan, slot_bytes: int) -> int:
        """The most segments of ``plan`` a chunk of one staging slot of ``slot_bytes`` holds."""
        sealed = plan.runs[0].extent.geometry.sealed_bytes if plan.runs else 1
        per_segment = 0 if self.all_mapped else sealed
        if not self._target.direct:
            per_segment += self.segment_bytes  # the slot also holds the decrypted chunk
        # Mapped chunks into their destination keep the slot-sized cut: a chunk is the unit of
        # scheduling, and fewer, larger ones cost less bookkeeping.
        return slot_bytes // (per_segment or sealed)

    def prepare(self, chunks: list[Chunk]) -> list[Work]:
        token_bytes = self.layout.token_bytes
        rows = self._target.block_rows
        direct = self._target.direct
        work: list[Work] = []
        for chunk in chunks:
            first, end = chunk.position, chunk.position + chunk.count
            # map() with a bound multiply: a generator cost ~0.45 ms per 2,048 blocks (128K tokens)
            starts = tuple(map(token_bytes.__mul__, rows[first:end])) if direct else ()
            keys = chunk.run.block_keys[chunk.first : chunk.first + chunk.count]
            size = chunk.count * chunk.run.extent.geometry.sealed_bytes
            work.append(Work(chunk, keys, size, starts))
        return work

    def open(
        self,
        layer: int,
        work: Work,
        output: LayerOutput,
        slot: Slot | None,
        *,
        group: int = 0,
        pause: Pause | None = None,
    ) -> tuple[BaseException | None, Span | None]:
        """Open one chunk into ``output``: straight out of the extent's mapping, or after
        reading its ciphertext into ``slot``. Returns the error, classified (never raised),
        and the mapped span it was opened from, to be dropped later (``MappedSpans``)."""
        # Without a slot (the caller helping) only a mapped chunk decrypted straight into its
        # destination can be opened; a worker is without one only once the load is cancelled.
        if self._cancelled.is_set() or (slot is None and self.needs_slot):
            return Cancelled(), None
        chunk = work.chunk
        extent = chunk.run.extent
        mapped = self._mapped[extent.extent_id]
        offset = extent.geometry.offset(layer, chunk.slot)
        span: Span | None = None
        try:
            if mapped is not None:
                span = (extent.extent_id, offset, offset + work.size)
                if offset + work.size > len(mapped):  # open_readers checked every size
                    raise ShortReadError("a chunk lies past the end of its mapped extent")
                ciphertext = mapped[offset : offset + work.size]
            else:
                assert slot is not None, "reading a chunk needs a staging slot"
                ciphertext = slot.view[: work.size]
                self.readers[extent.extent_id].readinto(offset, [ciphertext])
            if self._cancelled.is_set():
                return Cancelled(), span
            # Staged plaintext goes after the ciphertext read into the slot, or at the slot's
            # start when the ciphertext came from a mapping.
            plain_at = 0 if mapped is not None else work.size
            self._open_into(layer, work, output, ciphertext, slot, plain_at, group, pause)
        except BaseException as err:
            return classify(extent.extent_id, layer, err), span
        return None, span

    def _open_into(
        self,
        layer: int,
        work: Work,
        output: LayerOutput,
        ciphertext: memoryview,
        slot: Slot | None,
        plain_at: int,
        group: int,
        pause: Pause | None,
    ) -> None:
        chunk = work.chunk
        cipher = chunk.run.extent.cipher
        segment = self.segment_bytes
        if output.bytes is not None and self._target.direct:
            out = output.bytes
            outs = [out[start : start + segment] for start in work.starts]
            open_segments(cipher, layer, work, ciphertext, outs, group=group, pause=pause)
            return
        assert slot is not None, "a staged destination needs a staging slot"
        outs = [
            slot.view[plain_at + j * segment : plain_at + (j + 1) * segment]
            for j in range(chunk.count)
        ]
        open_segments(cipher, layer, work, ciphertext, outs, group=group, pause=pause)
        plain = slot.tensor[plain_at : plain_at + chunk.count * segment].view(chunk.count, segment)
        if self._stream is None:
            self._target.place(output, chunk.position, plain)
            return
        with torch.cuda.stream(self._stream):
            self._target.place(output, chunk.position, plain)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(self._stream)
        copied.synchronize()  # the slot is reused once this chunk's copy has finished

    def layer_event(self) -> Any:
        """On CUDA, an event recorded on the load's stream after a layer's last chunk (its
        copies are queued there); ``None`` on the CPU."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return event

    def drop(self, batch: SpanBatch) -> None:
        """Drop opened mapped spans from the process's resident set, adjacent ones together."""
        for extent_id, spans in batch.items():
            reader = self.readers.get(extent_id)  # None once a close elsewhere cleared them
            if reader is None:
                continue
            for start, end in merged_spans(spans):
                reader.done_with(start, end - start)


def classify(extent_id: str, layer: int, err: BaseException) -> BaseException:
    """What an error opening a chunk of ``extent_id`` is: an :class:`ExtentFailure` of its
    class, or :class:`Cancelled` (the stream or the cache's pools were closed)."""
    if isinstance(err, Cancelled | ExtentFailure):
        return err
    if isinstance(err, SealOpenError):
        return ExtentFailure(extent_id, layer, err, INTEGRITY)
    if isinstance(err, ShortReadError | ExtentNotFoundError):
        return ExtentFailure(extent_id, layer, err, LOST)
    if isinstance(err, RuntimeError) and "shutdown" in str(err):
        return Cancelled()  # the cache's pools were shut down under us
    if isinstance(err, Exception):  # StorageError (EMFILE, EIO, ...), or a bug
        return ExtentFailure(extent_id, layer, err, IO)
    return Cancelled()  # KeyboardInterrupt and the like: stop, as if closed
