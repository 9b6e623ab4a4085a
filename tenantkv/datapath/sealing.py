"""Sealing: a store's new blocks, layer by layer, into one sealed layer-major extent.

The store's way down the data path, as the loader is a load's way up. The namespace service
decides which blocks are new, checks the quota and builds the extent's cipher; this module seals
every (block, layer) segment of those blocks with that cipher on the runtime's sealing pool and
writes them through the block store at the offsets of ``extent_format.py``, then commits. It
takes the store, the pool and the cipher as arguments and opens no index transaction: indexing
the extent it returns (or deleting it when indexing fails) is the caller's.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future
from concurrent.futures import wait as wait_futures

import torch

from ..crypto import ExtentCipher
from ..prefix import BlockKey
from ..storage import BlockStore, ExtentWriter
from .extent_format import ExtentGeometry

#: The most sealed bytes one store task seals and writes at once (see :func:`seal_extent`).
STORE_PIECE_BYTES = 8 << 20


def seal_extent(
    store: BlockStore,
    geometry: ExtentGeometry,
    cipher: ExtentCipher,
    *,
    keys: Sequence[BlockKey],
    positions: Sequence[int],
    rows: Sequence[torch.Tensor],
    first_row_block: int,
    executor: Executor,
    workers: int,
    window: int,
    retain_for: float,
    owner: str = "",
) -> str:
    """Seal and write one extent on ``executor``, a bounded window of pieces at a time; then
    commit it and return its id.

    The extent holds ``geometry.num_blocks`` blocks: block ``positions[s]`` of the prefix whose
    block keys are ``keys`` goes to slot ``s``. ``rows`` holds one ``[T, token_bytes]`` uint8 CPU
    tensor per layer, starting at block ``first_row_block`` of the prefix (a store may be passed
    only the tokens after those already cached), so no position may lie before it.
    ``retain_for`` is the retention of the extent's class, for stores that expire extents
    themselves. ``owner`` (the tenant) is whose memory of recent writes keeps the extent
    (``BlockStore.create``). A failure (the store's StorageError, say) aborts the writer:
    nothing is left.

    A piece is up to ``STORE_PIECE_BYTES`` of one layer's segments: pieces go to disjoint
    offsets, so workers seal and write them in parallel (one ``write_at`` each; one worker
    seals while another waits on its write), no piece waits for another, and a worker's
    scratch memory stays bounded however long the prefix. The window (at least ``window``
    pieces, and two queued per one of the pool's ``workers``) keeps a large store from queueing
    all its pieces ahead of concurrent loads on a shared pool.
    """
    # Two pieces queued per worker: a worker that finishes one starts the next at once
    # instead of waiting for this thread to be scheduled and submit it.
    window = max(window, 2 * workers)
    per_piece = max(1, STORE_PIECE_BYTES // geometry.sealed_bytes)
    pieces = [
        (layer, first)
        for layer in range(geometry.num_layers)
        for first in range(0, geometry.num_blocks, per_piece)
    ]
    with store.create(owner) as writer:
        writer.reserve(geometry.total_bytes)
        writer.write_at(0, geometry.header())
        pending: set[Future[None]] = set()
        try:
            for layer, first in pieces:
                if len(pending) >= window:
                    done, pending = wait_futures(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()
                pending.add(
                    executor.submit(
                        _seal_and_write,
                        writer,
                        geometry,
                        cipher,
                        layer,
                        first,
                        keys,
                        positions[first : first + per_piece],
                        rows[layer],
                        first_row_block,
                    )
                )
            for future in wait_futures(pending).done:
                future.result()
        finally:
            for future in pending:
                future.cancel()
            wait_futures(pending)  # no worker may still write once the writer is aborted
        return writer.commit(retain_for=retain_for)


def _seal_and_write(
    writer: ExtentWriter,
    geometry: ExtentGeometry,
    cipher: ExtentCipher,
    layer: int,
    first_slot: int,
    keys: Sequence[BlockKey],
    positions: Sequence[int],
    rows: torch.Tensor,
    first_row_block: int,
) -> None:
    """Worker: seal the new segments ``first_slot ..`` (``len(positions)`` of them) of one
    layer into the writer's scratch memory and write them with one ``write_at``.

    ``rows`` starts at block ``first_row_block`` of the prefix (see ``Namespace.store(start=)``).
    """
    plain = geometry.segment_bytes
    offset = geometry.offset(layer, first_slot)
    out = writer.scratch(offset, len(positions) * geometry.sealed_bytes)
    source = memoryview(rows.numpy()).cast("B")  # type: ignore[arg-type]
    plaintexts = []
    for position in positions:
        row_block = position - first_row_block
        assert row_block >= 0, "a stored block lies before the rows the caller passed"
        plaintexts.append(source[row_block * plain : (row_block + 1) * plain])
    cipher.seal_many_into(
        first_slot, layer, [keys[position] for position in positions], plaintexts, out
    )
    writer.write_at(offset, out)
