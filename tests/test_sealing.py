"""Sealing (``tenantkv.datapath.sealing``) on its own: no index, no cache, a local block store.

The extent it writes is compared with one re-derived segment by segment from the documented
layout (``extent_format.py``) with :meth:`ExtentCipher.seal_into`, opened back with the cipher,
and a store or seal that fails part-way must leave neither an extent nor a temporary behind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from typing_extensions import Buffer

from tenantkv.crypto import CipherSuite, ExtentCipher, SealOpenError, SegmentContext
from tenantkv.datapath import sealing
from tenantkv.datapath.extent_format import HEADER_BYTES, ExtentGeometry
from tenantkv.prefix import BlockKey
from tenantkv.storage import ExtentWriter, LocalBlockStore, StorageError
from tests.block_stores import temporaries

LAYERS = 3
TOKEN_BYTES = 40
BLOCK_TOKENS = 16
SEGMENT = BLOCK_TOKENS * TOKEN_BYTES
SUITE = CipherSuite(1)
#: A prefix of 9 blocks; the caller passes rows from block 2 on; blocks 3 and 6 are cached.
PREFIX_BLOCKS = 9
FIRST_ROW_BLOCK = 2
POSITIONS = [2, 4, 5, 7, 8]


def _cipher() -> ExtentCipher:
    context = SegmentContext(b"t" * 16, 7, b"n" * 16)
    return ExtentCipher(b"k" * 32, b"s" * 16, context, SUITE)


def _keys() -> list[BlockKey]:
    return [BlockKey(bytes([block + 1]) * 32) for block in range(PREFIX_BLOCKS)]


def _rows() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    rows = (PREFIX_BLOCKS - FIRST_ROW_BLOCK) * BLOCK_TOKENS
    return [
        torch.randint(0, 256, (rows, TOKEN_BYTES), generator=generator, dtype=torch.uint8)
        for _ in range(LAYERS)
    ]


def _geometry() -> ExtentGeometry:
    return ExtentGeometry(len(POSITIONS), LAYERS, SEGMENT, SUITE)


def _plaintext(rows: list[torch.Tensor], layer: int, position: int) -> bytes:
    start = (position - FIRST_ROW_BLOCK) * BLOCK_TOKENS
    return rows[layer][start : start + BLOCK_TOKENS].numpy().tobytes()


def _seal(
    store: LocalBlockStore,
    rows: list[torch.Tensor],
    executor: Any,
    *,
    workers: int = 2,
    keys: list[BlockKey] | None = None,
) -> str:
    return sealing.seal_extent(
        store,
        _geometry(),
        _cipher(),
        keys=_keys() if keys is None else keys,
        positions=POSITIONS,
        rows=rows,
        first_row_block=FIRST_ROW_BLOCK,
        executor=executor,
        workers=workers,
        window=1,
        retain_for=60.0,
    )


def _expected_extent(rows: list[torch.Tensor]) -> bytes:
    """The extent from the documented layout, one ``seal_into`` per (layer, slot)."""
    geometry, cipher, keys = _geometry(), _cipher(), _keys()
    out = bytearray(geometry.total_bytes)
    out[:HEADER_BYTES] = geometry.header()
    for layer in range(LAYERS):
        for slot, position in enumerate(POSITIONS):
            offset = geometry.offset(layer, slot)
            cipher.seal_into(
                slot,
                layer,
                keys[position],
                memoryview(_plaintext(rows, layer, position)),
                memoryview(out)[offset : offset + geometry.sealed_bytes],
            )
    return bytes(out)


@pytest.mark.parametrize("piece_blocks", [None, 1, 2])
def test_the_extent_is_the_documented_layout_and_opens_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece_blocks: int | None
) -> None:
    """Whatever the pieces (one per layer, or one or two blocks each, more than the window),
    the bytes are those of the layout, and every segment opens to its block's rows."""
    if piece_blocks is not None:
        monkeypatch.setattr(sealing, "STORE_PIECE_BYTES", piece_blocks * (SEGMENT + 16))
    store = LocalBlockStore(tmp_path, durable=False)
    rows = _rows()
    with ThreadPoolExecutor(2) as executor:
        extent_id = _seal(store, rows, executor)
    data = store.path_of(extent_id).read_bytes()
    assert data == _expected_extent(rows)
    geometry, cipher, keys = _geometry(), _cipher(), _keys()
    plain = bytearray(SEGMENT)
    for layer in range(LAYERS):
        for slot, position in enumerate(POSITIONS):
            offset = geometry.offset(layer, slot)
            sealed = memoryview(data)[offset : offset + geometry.sealed_bytes]
            cipher.open_into(slot, layer, keys[position], sealed, memoryview(plain))
            assert bytes(plain) == _plaintext(rows, layer, position)
            # Bound to its block: the key of the block before it does not open it.
            with pytest.raises(SealOpenError):
                cipher.open_into(slot, layer, keys[position - 1], sealed, memoryview(plain))
    assert list(store.list()) == [extent_id]
    assert temporaries(store) == 0


class _FailingStore(LocalBlockStore):
    """Writes fail, like a full disk, from the ``fail_at``-th ``write_at`` (the header is the
    first), after part of the bytes went down."""

    def __init__(self, root: Path, fail_at: int) -> None:
        super().__init__(root, durable=False)
        self.fail_at = fail_at

    def create(self, owner: str = "") -> ExtentWriter:
        writer = super().create(owner)
        real_write_at = writer.write_at
        calls = 0
        lock = threading.Lock()

        def write_at(offset: int, data: Buffer) -> None:
            nonlocal calls
            with lock:
                calls += 1
                failing = calls >= self.fail_at
            if failing:
                real_write_at(offset, memoryview(data)[:1])
                raise StorageError("writing extent failed: no space left on device")
            real_write_at(offset, data)

        writer.write_at = write_at  # type: ignore[method-assign]
        return writer


@pytest.mark.parametrize("fail_at", [1, 2, 5])
def test_a_failed_write_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    monkeypatch.setattr(sealing, "STORE_PIECE_BYTES", SEGMENT + 16)  # 15 pieces
    store = _FailingStore(tmp_path, fail_at)
    with ThreadPoolExecutor(2) as executor, pytest.raises(StorageError, match="no space"):
        _seal(store, _rows(), executor)
    assert list(store.list()) == []
    assert temporaries(store) == 0


def test_a_failed_seal_leaves_nothing_behind(tmp_path: Path) -> None:
    """A worker that raises (here: a block key of the wrong length) aborts the extent."""
    store = LocalBlockStore(tmp_path, durable=False)
    keys = _keys()
    keys[POSITIONS[-1]] = BlockKey(b"short")
    with ThreadPoolExecutor(2) as executor, pytest.raises(ValueError, match="block key"):
        _seal(store, _rows(), executor, keys=keys)
    assert list(store.list()) == []
    assert temporaries(store) == 0


class _CountingExecutor(ThreadPoolExecutor):
    """Counts the tasks submitted and not yet run to their end; remembers the most at once.

    A task counts itself off before its future is done, so a submitter woken by that future
    never sees it still counted."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self._count_lock = threading.Lock()
        self.outstanding = 0
        self.most = 0

    def submit(  # type: ignore[override]
        self, fn: Callable[..., None], /, *args: Any, **kwargs: Any
    ) -> Future[None]:
        with self._count_lock:
            self.outstanding += 1
            self.most = max(self.most, self.outstanding)
        return super().submit(self._counted, fn, *args, **kwargs)

    def _counted(self, fn: Callable[..., None], /, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        finally:
            with self._count_lock:
                self.outstanding -= 1


class _SlowStore(LocalBlockStore):
    """Every piece's write takes a while, so unbounded submission would pile pieces up."""

    def create(self, owner: str = "") -> ExtentWriter:
        writer = super().create(owner)
        real_write_at = writer.write_at

        def write_at(offset: int, data: Buffer) -> None:
            if offset:  # not the header: a piece
                time.sleep(0.01)
            real_write_at(offset, data)

        writer.write_at = write_at  # type: ignore[method-assign]
        return writer


def test_a_store_keeps_two_pieces_per_worker_in_flight_at_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sealing, "STORE_PIECE_BYTES", SEGMENT + 16)  # 15 pieces
    store = _SlowStore(tmp_path, durable=False)
    rows = _rows()
    with _CountingExecutor(1) as executor:
        extent_id = _seal(store, rows, executor, workers=1)
    assert executor.most == 2
    assert store.path_of(extent_id).read_bytes() == _expected_extent(rows)
