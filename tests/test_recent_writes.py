"""The ring of recently written extents (tenantkv.storage.recent_writes) and the local store's
use of it: a durable store keeps what it wrote in memory, and the first load of it reads
there; never other bytes than the file's, regions in use never overwritten."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tenantkv
from tenantkv.config import CacheConfig
from tenantkv.errors import InvalidRequestError
from tenantkv.storage.errors import ExtentNotFoundError, ShortReadError
from tenantkv.storage.local import LocalBlockStore
from tenantkv.storage.recent_writes import RecentWrites, Reservation
from tests.helpers import MHA_SMALL, random_layers, random_tokens

PAGE = mmap.PAGESIZE
IDENTITY = (1, 2, 3)


def _write(store: LocalBlockStore, data: bytes, *, through_scratch: bool = True) -> str:
    """An extent written as the cache writes one: reserve, then disjoint pieces."""
    with store.create() as writer:
        writer.reserve(len(data))
        half = len(data) // 2
        for offset, piece in ((0, data[:half]), (half, data[half:])):
            if through_scratch:
                out = writer.scratch(offset, len(piece))
                out[:] = piece
                writer.write_at(offset, out)
            else:
                writer.write_at(offset, piece)
        return writer.commit()


def _read(store: LocalBlockStore, extent_id: str) -> tuple[bytes, bool]:
    """The extent's bytes, and whether they came out of the ring (a reader with a mapping:
    this store does not map files, ``map_reads=False``)."""
    with store.open(extent_id) as reader:
        buffer = bytearray(reader.size)
        reader.readinto(0, [buffer])
        mapped = reader.mapped()
        if mapped is not None:
            assert bytes(mapped) == bytes(buffer)
        return bytes(buffer), mapped is not None


@pytest.fixture
def store(tmp_path: Path) -> LocalBlockStore:
    store = LocalBlockStore(
        tmp_path / "blocks", durable=True, direct=True, map_reads=False, recent_bytes=16 * PAGE
    )
    if store.recent is None:
        pytest.skip("this platform has no O_DIRECT")
    yield store
    store.close()


def test_a_written_extent_is_read_from_the_ring_and_equals_the_file(store: LocalBlockStore) -> None:
    data = os.urandom(3 * PAGE + 123)
    for through_scratch in (True, False):  # sealers' scratch memory, or bytes copied in
        extent_id = _write(store, data, through_scratch=through_scratch)
        assert _read(store, extent_id) == (data, True)
        assert store.path_of(extent_id).read_bytes() == data  # the file has the same bytes
    control = LocalBlockStore(store.root, durable=True, direct=True, map_reads=False)
    assert _read(control, extent_id) == (data, False)  # control: no ring, read from the file


def test_deleted_or_replaced_files_are_not_served_from_memory(store: LocalBlockStore) -> None:
    kept = _write(store, os.urandom(PAGE))
    assert _read(store, kept)[1]  # positive control
    deleted = _write(store, os.urandom(PAGE))
    store.path_of(deleted).unlink()  # behind the store's back
    with pytest.raises(ExtentNotFoundError):
        store.open(deleted)
    replaced = _write(store, os.urandom(PAGE))
    other = os.urandom(PAGE)
    path = store.path_of(replaced)
    (path.parent / "swap").write_bytes(other)
    os.replace(path.parent / "swap", path)  # another inode under the same name
    assert _read(store, replaced) == (other, False)
    removed = _write(store, os.urandom(PAGE))
    assert store.delete(removed) and store.recent is not None
    assert not store.recent.holds(removed)
    with pytest.raises(ExtentNotFoundError):
        store.open(removed)


def test_too_large_torn_or_aborted_extents_are_not_kept(store: LocalBlockStore) -> None:
    ring = store.recent
    assert ring is not None
    large = _write(store, os.urandom(17 * PAGE))  # larger than the ring
    assert not ring.holds(large) and _read(store, large)[1] is False
    with store.create() as writer:  # more bytes than reserved: the ring does not add up
        writer.reserve(PAGE)
        writer.write_at(0, os.urandom(PAGE))
        writer.write_at(PAGE, os.urandom(10))
        grown = writer.commit()
    assert not ring.holds(grown)
    assert len(_read(store, grown)[0]) == PAGE + 10  # the file is whole all the same
    writer = store.create()
    writer.reserve(2 * PAGE)
    writer.write_at(0, os.urandom(2 * PAGE))
    writer.abort()
    assert ring.left_out == 1 and ring.kept == 0  # the large one; the others were reserved
    assert _write(store, os.urandom(16 * PAGE))  # the aborted region is free again
    assert ring.kept == 1


def test_a_region_being_read_is_never_overwritten(store: LocalBlockStore) -> None:
    first = os.urandom(8 * PAGE)
    first_id = _write(store, first)
    reader = store.open(first_id)
    mapped = reader.mapped()
    assert mapped is not None
    # Fill the ring round twice while the reader holds the first region.
    for _ in range(4):
        _write(store, os.urandom(8 * PAGE))
    assert bytes(mapped) == first
    del mapped
    reader.close()
    assert store.recent is not None and store.recent.left_out > 0


def test_short_reads_past_the_end_raise(store: LocalBlockStore) -> None:
    extent_id = _write(store, os.urandom(PAGE))
    with store.open(extent_id) as reader:
        assert reader.mapped() is not None
        with pytest.raises(ShortReadError):
            reader.readinto(PAGE - 10, [bytearray(20)])
        reader.readinto(PAGE, [bytearray(0)])  # a read of zero bytes succeeds anywhere


class RingMachine(RuleBasedStateMachine):
    """The ring against a model: what a reservation wrote is what a reader reads, for as long
    as the ring says it holds it; a region in use is never handed to another reservation."""

    def __init__(self) -> None:
        super().__init__()
        self.ring = RecentWrites(8 * PAGE)
        self.counter = 0
        self.writing: dict[str, tuple[Reservation, bytes]] = {}
        self.written: dict[str, bytes] = {}  # the model: every extent committed, by id
        self.readers: list[tuple[str, object, bytes]] = []

    @rule(pages=st.integers(1, 9), tail=st.integers(0, PAGE - 1))
    def reserve(self, pages: int, tail: int) -> None:
        size = (pages - 1) * PAGE + tail + 1
        self.counter += 1
        extent_id = f"{self.counter:032x}"
        reservation = self.ring.reserve(extent_id, size)
        if reservation is None:
            return
        data = os.urandom(size)
        reservation.view[:] = data
        self.writing[extent_id] = (reservation, data)

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), commit=st.booleans())
    def finish(self, data: st.DataObject, commit: bool) -> None:
        extent_id = data.draw(st.sampled_from(sorted(self.writing)))
        reservation, content = self.writing.pop(extent_id)
        if commit:
            reservation.commit(len(content), IDENTITY)
            self.written[extent_id] = content
        else:
            reservation.abort()

    @precondition(lambda self: self.written)
    @rule(data=st.data())
    def open_reader(self, data: st.DataObject) -> None:
        extent_id = data.draw(st.sampled_from(sorted(self.written)))
        reader = self.ring.open(extent_id, lambda: IDENTITY)
        if reader is not None:
            self.readers.append((extent_id, reader, self.written[extent_id]))

    @precondition(lambda self: self.readers)
    @rule(data=st.data())
    def close_reader(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.readers) - 1))
        _, reader, _ = self.readers.pop(index)
        reader.close()  # type: ignore[attr-defined]

    @precondition(lambda self: self.written)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        extent_id = data.draw(st.sampled_from(sorted(self.written)))
        self.ring.drop(extent_id)
        assert not self.ring.holds(extent_id)

    @invariant()
    def readers_and_writers_keep_their_bytes(self) -> None:
        for _, reader, content in self.readers:
            assert bytes(reader.mapped()) == content  # type: ignore[attr-defined]
        for reservation, content in self.writing.values():
            assert bytes(reservation.view) == content

    @invariant()
    def held_extents_read_as_written(self) -> None:
        for extent_id, content in self.written.items():
            if self.ring.holds(extent_id):
                reader = self.ring.open(extent_id, lambda: IDENTITY)
                assert reader is not None
                assert bytes(reader.mapped()) == content  # type: ignore[union-attr]
                reader.close()

    def teardown(self) -> None:
        for _, reader, _ in self.readers:
            reader.close()  # type: ignore[attr-defined]
        for reservation, _ in self.writing.values():
            reservation.abort()
        self.ring.close()


RingMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_ring_against_a_model = RingMachine.TestCase


def test_a_durable_caches_first_load_after_a_store_reads_the_ring(
    tmp_path: Path, index: object
) -> None:
    with tenantkv.open(tmp_path / "cache", map_reads=False) as kv:
        store = kv.context.blocks
        assert isinstance(store, LocalBlockStore)
        if store.recent is None:
            pytest.skip("this platform has no O_DIRECT")
        kv.create_tenant("acme")
        namespace = kv.namespace("acme", model="m", layout=MHA_SMALL)
        tokens = random_tokens(128)
        layers = random_layers(MHA_SMALL, 128, seed=3)
        assert namespace.store(tokens, layers) == 128
        assert store.recent.kept == 1
        with namespace.load(tokens) as stream:
            got = [layer for _, layer in stream]
        assert store.recent.served == 1
        for layer, want in zip(got, layers, strict=True):
            assert torch.equal(layer[0], want[0]) and torch.equal(layer[1], want[1])
    with tenantkv.open(tmp_path / "cache", recent_writes_bytes=0) as kv:  # control: no ring
        assert kv.context.blocks.recent is None  # type: ignore[attr-defined]
        namespace = kv.namespace("acme", model="m", layout=MHA_SMALL)
        with namespace.load(tokens) as stream:
            again = [layer for _, layer in stream]
        assert all(torch.equal(a[0], b[0]) for a, b in zip(again, got, strict=True))


@pytest.mark.parametrize("bad", [-1, True, 1.5, "256"])
def test_the_rings_size_takes_only_a_non_negative_integer(bad: object) -> None:
    with pytest.raises(InvalidRequestError, match="recent_writes_bytes"):
        CacheConfig(recent_writes_bytes=bad)  # type: ignore[arg-type]
    assert CacheConfig(recent_writes_bytes=0).recent_writes_bytes == 0  # control: 0 is off


def test_the_rings_size_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENANTKV_RECENT_WRITES_BYTES", "4096")
    assert CacheConfig.from_env().recent_writes_bytes == 4096
