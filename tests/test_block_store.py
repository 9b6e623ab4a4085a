"""Tests of every block store (local directory, Redis, Redis in front of a directory): a stateful
model check plus targeted cases. Tests of the local layout (paths, modes) use ``local_store``."""

from __future__ import annotations

import array
import errno
import os
import random
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tenantkv.storage import (
    BlockStore,
    ExtentNotFoundError,
    ExtentReader,
    ExtentWriter,
    LocalBlockStore,
    ShortReadError,
    StorageError,
)
from tests.block_stores import (
    BACKENDS,
    drop_prefix,
    make_store,
    new_prefix,
    temporaries,
)

ID_RE = re.compile(r"[0-9a-f]{32}")


def _hex_ids() -> st.SearchStrategy[str]:
    return st.binary(min_size=16, max_size=16).map(bytes.hex)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    pieces: list[bytes] = []
    start = 0
    for point in [*points, len(data)]:
        pieces.append(data[start:point])
        start = point
    return pieces


def _salted(chunk: bytes, position: int) -> bytes:
    """Mix the stream position into the bytes, so misplaced bytes show even in all-zero data."""
    return bytes((b + position + k) & 0xFF for k, b in enumerate(chunk))


def _salted_chunks(chunks: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    position = 0
    for chunk in chunks:
        out.append(_salted(chunk, position))
        position += len(chunk)
    return out


CHUNKS = st.lists(st.binary(max_size=64), max_size=6).map(_salted_chunks)


# ------------------------------------------------------------------------------------------------
# Stateful model check
# ------------------------------------------------------------------------------------------------


class BlockStoreMachine(RuleBasedStateMachine):
    """A block store against a dict of committed extents and a dict of writers in progress;
    subclasses below run it on each backend."""

    extents = Bundle("extents")
    backend = "local"

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tenantkv-bs-"))
        self.prefix = new_prefix()
        self.store = make_store(self.backend, self.root, self.prefix)
        self.model: dict[str, bytes] = {}
        self.ever_committed: set[str] = set()
        self.pending: dict[int, tuple[ExtentWriter, bytearray]] = {}
        self.next_pending = 0

    def teardown(self) -> None:
        for writer, _ in self.pending.values():
            writer.abort()
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)
        if not self.backend.startswith("local"):
            drop_prefix(self.prefix)

    # -- writes --------------------------------------------------------------------------------

    def _record_commit(self, extent_id: str, data: bytes) -> None:
        note(f"committed {extent_id} ({len(data)} bytes)")
        assert ID_RE.fullmatch(extent_id), extent_id
        assert extent_id not in self.ever_committed, f"id {extent_id} reused"
        self.ever_committed.add(extent_id)
        self.model[extent_id] = data

    @initialize(target=extents)
    def seed_extent(self) -> str:
        with self.store.create() as writer:
            writer.write(b"seed")
            extent_id = writer.commit()
        self._record_commit(extent_id, b"seed")
        return extent_id

    @rule(target=extents, chunks=CHUNKS)
    def create_write_commit(self, chunks: list[bytes]) -> str:
        with self.store.create() as writer:
            for chunk in chunks:
                writer.write(chunk)
            extent_id = writer.commit()
        self._record_commit(extent_id, b"".join(chunks))
        return extent_id

    @rule(chunks=CHUNKS, via_exception=st.booleans())
    def create_write_abort(self, chunks: list[bytes], via_exception: bool) -> None:
        note(f"abort after {len(chunks)} chunks (via exception: {via_exception})")
        before = set(self.store.list())
        if via_exception:
            with pytest.raises(RuntimeError, match="boom"), self.store.create() as writer:
                for chunk in chunks:
                    writer.write(chunk)
                raise RuntimeError("boom")
        else:
            writer = self.store.create()
            for chunk in chunks:
                writer.write(chunk)
            writer.abort()
            writer.abort()  # idempotent
        assert set(self.store.list()) == before

    @rule()
    def start_writer(self) -> None:
        self.pending[self.next_pending] = (self.store.create(), bytearray())
        note(f"started writer {self.next_pending}")
        self.next_pending += 1

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data(), chunk=st.binary(min_size=1, max_size=64))
    def write_pending(self, data: st.DataObject, chunk: bytes) -> None:
        number = data.draw(st.sampled_from(sorted(self.pending)), label="writer")
        writer, written = self.pending[number]
        chunk = _salted(chunk, len(written))
        writer.write(chunk)
        written += chunk

    @precondition(lambda self: bool(self.pending))
    @rule(target=extents, data=st.data())
    def commit_pending(self, data: st.DataObject) -> str:
        number = data.draw(st.sampled_from(sorted(self.pending)), label="writer")
        writer, written = self.pending.pop(number)
        extent_id = writer.commit()
        with pytest.raises(StorageError):
            writer.commit()
        self._record_commit(extent_id, bytes(written))
        return extent_id

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def abort_pending(self, data: st.DataObject) -> None:
        number = data.draw(st.sampled_from(sorted(self.pending)), label="writer")
        writer, _ = self.pending.pop(number)
        note(f"aborted writer {number}")
        writer.abort()
        with pytest.raises(StorageError):
            writer.write(b"late")
        with pytest.raises(StorageError):
            writer.commit()

    # -- reads ---------------------------------------------------------------------------------

    @rule(extent_id=extents, data=st.data())
    def read_range(self, extent_id: str, data: st.DataObject) -> None:
        if extent_id not in self.model:
            note(f"open of deleted {extent_id}")
            with pytest.raises(ExtentNotFoundError):
                self.store.open(extent_id)
            return
        expected = self.model[extent_id]
        size = len(expected)
        # Mostly ranges inside the extent, sometimes a little past its end.
        offset = data.draw(st.integers(0, size + 2), label="offset")
        length = data.draw(st.integers(0, max(0, size - offset) + 2), label="length")
        cuts = data.draw(st.lists(st.integers(0, length), max_size=4), label="cuts")
        buffers = [bytearray(len(piece)) for piece in _split(bytes(length), cuts)]
        note(f"read {extent_id}[{offset}:{offset + length}] into {[len(b) for b in buffers]}")
        with self.store.open(extent_id) as reader:
            assert reader.size == size
            # A zero-length read asks for no bytes, so it succeeds even past the end.
            if offset + length <= size or length == 0:
                reader.readinto(offset, buffers)
                assert b"".join(buffers) == expected[offset : offset + length]
            else:
                with pytest.raises(ShortReadError):
                    reader.readinto(offset, buffers)

    @rule(extent_id=extents)
    def read_whole(self, extent_id: str) -> None:
        if extent_id not in self.model:
            with pytest.raises(ExtentNotFoundError):
                self.store.open(extent_id)
            return
        expected = self.model[extent_id]
        buffer = bytearray(len(expected))
        with self.store.open(extent_id) as reader:
            reader.readinto(0, [buffer])
        assert bytes(buffer) == expected

    @rule(extent_id=_hex_ids())
    def open_unknown(self, extent_id: str) -> None:
        if extent_id in self.model:  # astronomically unlikely; keep the rule honest anyway
            return
        with pytest.raises(ExtentNotFoundError):
            self.store.open(extent_id)

    # -- deletes -------------------------------------------------------------------------------

    @rule(extent_id=extents)
    def delete(self, extent_id: str) -> None:
        existed = extent_id in self.model
        note(f"delete {extent_id} (exists in model: {existed})")
        assert self.store.delete(extent_id) is existed
        self.model.pop(extent_id, None)
        assert self.store.delete(extent_id) is False

    @rule(extent_id=_hex_ids())
    def delete_unknown(self, extent_id: str) -> None:
        if extent_id in self.model:
            return
        assert self.store.delete(extent_id) is False

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def list_matches_model(self) -> None:
        listed = list(self.store.list())
        assert len(listed) == len(set(listed)), "list() repeats an id"
        assert set(listed) == set(self.model)

    @invariant()
    def temporaries_match_pending_writers(self) -> None:
        assert temporaries(self.store) == len(self.pending)

    @invariant()
    def sizes_match_model(self) -> None:
        for extent_id, data in self.model.items():
            with self.store.open(extent_id) as reader:
                assert reader.size == len(data)


class PreadvBlockStoreMachine(BlockStoreMachine):
    backend = "local-preadv"


class DirectBlockStoreMachine(BlockStoreMachine):
    backend = "local-direct"


class RedisBlockStoreMachine(BlockStoreMachine):
    backend = "redis"


class TieredBlockStoreMachine(BlockStoreMachine):
    backend = "tiered"


_MACHINE_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Network round trips make the Redis-backed runs slower per step: fewer examples, same steps.
_NETWORK_SETTINGS = settings(_MACHINE_SETTINGS, max_examples=20)
BlockStoreMachine.TestCase.settings = _MACHINE_SETTINGS
PreadvBlockStoreMachine.TestCase.settings = _MACHINE_SETTINGS
RedisBlockStoreMachine.TestCase.settings = _NETWORK_SETTINGS
TieredBlockStoreMachine.TestCase.settings = _NETWORK_SETTINGS
DirectBlockStoreMachine.TestCase.settings = _MACHINE_SETTINGS
TestBlockStoreMachine = BlockStoreMachine.TestCase
TestPreadvBlockStoreMachine = PreadvBlockStoreMachine.TestCase
TestDirectBlockStoreMachine = DirectBlockStoreMachine.TestCase
TestRedisBlockStoreMachine = RedisBlockStoreMachine.TestCase
TestTieredBlockStoreMachine = TieredBlockStoreMachine.TestCase


# ------------------------------------------------------------------------------------------------
# Plain tests
# ------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fixed_umask() -> Iterator[None]:
    """A permissive umask, so file modes reflect what the store asks for, not the umask."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.fixture
def local_store(tmp_path: Path) -> LocalBlockStore:
    return LocalBlockStore(tmp_path / "blocks", durable=False)


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlockStore]:
    """Each backend in turn; Redis ones under a key prefix of their own, dropped afterwards."""
    prefix = new_prefix()
    backend = make_store(request.param, tmp_path / "blocks", prefix)
    try:
        yield backend
    finally:
        backend.close()
        if not request.param.startswith("local"):
            drop_prefix(prefix)


def _put(store: BlockStore, data: bytes) -> str:
    with store.create() as writer:
        writer.write(data)
        return writer.commit()


def _read_all(store: BlockStore, extent_id: str) -> bytes:
    with store.open(extent_id) as reader:
        buffer = bytearray(reader.size)
        reader.readinto(0, [buffer])
    return bytes(buffer)


def _parts(store: LocalBlockStore) -> list[Path]:
    return sorted(store.temp_dir.glob("*.part"))


def _extent_files(store: LocalBlockStore) -> list[Path]:
    return sorted(p for p in store.extent_dir.rglob("*") if p.is_file())


def test_store_is_a_block_store(store: BlockStore) -> None:
    assert isinstance(store, BlockStore)
    assert isinstance(store.create(), ExtentWriter)
    extent_id = _put(store, b"x")
    with store.open(extent_id) as reader:
        assert isinstance(reader, ExtentReader)


def test_extent_is_invisible_until_commit(local_store: LocalBlockStore) -> None:
    writer = local_store.create()
    writer.write(b"hello ")
    writer.write(b"world")
    assert list(local_store.list()) == []
    assert _extent_files(local_store) == []
    parts = _parts(local_store)
    assert len(parts) == 1
    pending_id = parts[0].name.removesuffix(".part")
    assert ID_RE.fullmatch(pending_id)
    with pytest.raises(ExtentNotFoundError):
        local_store.open(pending_id)
    assert local_store.delete(pending_id) is False
    assert _parts(local_store) == parts  # delete of the pending id did not touch the temp file

    extent_id = writer.commit()
    assert extent_id == pending_id
    assert list(local_store.list()) == [extent_id]
    assert _parts(local_store) == []
    assert _extent_files(local_store) == [local_store.path_of(extent_id)]
    assert _read_all(local_store, extent_id) == b"hello world"


def test_extent_path_layout(local_store: LocalBlockStore) -> None:
    extent_id = _put(local_store, b"abc")
    path = local_store.path_of(extent_id)
    assert path == local_store.root / "extents" / extent_id[:2] / f"{extent_id}.tkx"
    assert path.read_bytes() == b"abc"


def test_context_manager_aborts_on_exception(local_store: LocalBlockStore) -> None:
    keep = _put(local_store, b"keep")
    with pytest.raises(ValueError, match="boom"), local_store.create() as writer:
        writer.write(b"doomed bytes")
        assert len(_parts(local_store)) == 1
        raise ValueError("boom")
    assert _parts(local_store) == []
    assert list(local_store.list()) == [keep]
    assert _extent_files(local_store) == [local_store.path_of(keep)]
    with pytest.raises(StorageError):
        writer.write(b"more")
    with pytest.raises(StorageError):
        writer.commit()


def test_context_manager_without_exception_and_without_commit_leaves_writer_open(
    store: BlockStore,
) -> None:
    """Leaving the block normally neither commits nor aborts; the caller still can commit."""
    with store.create() as writer:
        writer.write(b"later")
    assert list(store.list()) == []
    extent_id = writer.commit()
    assert _read_all(store, extent_id) == b"later"


def test_abort_after_commit_keeps_the_extent(store: BlockStore) -> None:
    writer = store.create()
    writer.write(b"committed")
    extent_id = writer.commit()
    writer.abort()
    assert _read_all(store, extent_id) == b"committed"
    with pytest.raises(StorageError):
        writer.write(b"x")


def test_empty_extent(store: BlockStore) -> None:
    extent_id = _put(store, b"")
    with store.open(extent_id) as reader:
        assert reader.size == 0
        reader.readinto(0, [])
        reader.readinto(0, [bytearray(0)])
        with pytest.raises(ShortReadError):
            reader.readinto(0, [bytearray(1)])


def test_write_accepts_any_buffer(store: BlockStore) -> None:
    words = array.array("I", [1, 2, 3, 0xDEADBEEF])
    with store.create() as writer:
        writer.write(memoryview(words))
        writer.write(bytearray(b"tail"))
        writer.write(memoryview(b"0123456789")[2:5])
        extent_id = writer.commit()
    assert _read_all(store, extent_id) == words.tobytes() + b"tail" + b"234"


def test_large_extent_in_many_chunks(store: BlockStore) -> None:
    data = os.urandom(1 << 20)
    with store.create() as writer:
        for start in range(0, len(data), 4096 + 7):
            writer.write(data[start : start + 4096 + 7])
        extent_id = writer.commit()
    assert _read_all(store, extent_id) == data
    out = bytearray(1000)
    with store.open(extent_id) as reader:
        reader.readinto(len(data) - 1000, [out])
    assert out == data[-1000:]


@pytest.mark.parametrize(("offset", "length"), [(0, 11), (5, 6), (10, 1), (11, 1), (100, 1)])
def test_readinto_past_the_end_raises_short_read(
    store: BlockStore, offset: int, length: int
) -> None:
    extent_id = _put(store, b"0123456789")
    with store.open(extent_id) as reader:
        with pytest.raises(ShortReadError):
            reader.readinto(offset, [bytearray(length)])
        # Positive control: the range that does exist reads fine.
        available = max(0, 10 - offset)
        head = bytearray(min(length, available))
        reader.readinto(min(offset, 10), [head])
        assert bytes(head) == b"0123456789"[offset : offset + len(head)]


def test_readinto_up_to_the_end_succeeds(store: BlockStore) -> None:
    extent_id = _put(store, b"0123456789")
    with store.open(extent_id) as reader:
        tail = bytearray(3)
        reader.readinto(7, [tail])
        assert tail == b"789"
        reader.readinto(10, [bytearray(0)])


def test_short_read_across_scatter_buffers(store: BlockStore) -> None:
    extent_id = _put(store, b"0123456789")
    with store.open(extent_id) as reader:
        with pytest.raises(ShortReadError):
            reader.readinto(2, [bytearray(4), bytearray(4), bytearray(1)])
        reader.readinto(2, [bytearray(4), bytearray(4)])  # exactly to the end: fine


def test_readinto_scatters_in_order(store: BlockStore) -> None:
    data = bytes(range(256)) * 4
    extent_id = _put(store, data)
    sizes = [1, 0, 7, 64, 3, 200]
    buffers = [bytearray(n) for n in sizes]
    with store.open(extent_id) as reader:
        reader.readinto(17, buffers)
    position = 17
    for size, buffer in zip(sizes, buffers, strict=True):
        assert bytes(buffer) == data[position : position + size]
        position += size


def test_readinto_into_memoryviews_and_typed_arrays(store: BlockStore) -> None:
    data = os.urandom(64)
    extent_id = _put(store, data)
    backing = bytearray(80)
    words = array.array("H", [0] * 8)  # 16 bytes
    with store.open(extent_id) as reader:
        reader.readinto(0, [memoryview(backing)[10:58], words])
    assert bytes(backing[10:58]) == data[:48]
    assert backing[:10] == bytes(10) and backing[58:] == bytes(22)  # nothing written outside
    assert words.tobytes() == data[48:64]


def test_readinto_many_buffers(store: BlockStore) -> None:
    data = os.urandom(3000)
    extent_id = _put(store, data)
    buffers = [bytearray(1) for _ in range(len(data))]
    with store.open(extent_id) as reader:
        reader.readinto(0, buffers)
    assert b"".join(buffers) == data


def test_reader_close_is_idempotent_and_final(store: BlockStore) -> None:
    extent_id = _put(store, b"abc")
    reader = store.open(extent_id)
    buffer = bytearray(3)
    reader.readinto(0, [buffer])
    assert buffer == b"abc"
    reader.close()
    reader.close()
    with pytest.raises(StorageError):
        reader.readinto(0, [bytearray(1)])


@pytest.mark.parametrize(
    "bad_id",
    [
        "",
        "xyz",
        "0" * 31,
        "0" * 33,
        "g" * 32,
        "../" + "0" * 29,
        "0" * 32 + ".tkx",
        "0" * 16 + "/" + "0" * 15,
        " " + "0" * 31,
    ],
)
def test_open_malformed_id_raises_not_found(store: BlockStore, bad_id: str) -> None:
    with pytest.raises(ExtentNotFoundError):
        store.open(bad_id)


def test_open_unknown_id_raises_not_found(store: BlockStore) -> None:
    extent_id = _put(store, b"data")
    assert _read_all(store, extent_id) == b"data"  # positive control
    unknown = ("0" if extent_id[0] != "0" else "1") + extent_id[1:]
    with pytest.raises(ExtentNotFoundError):
        store.open(unknown)
    with pytest.raises(ExtentNotFoundError):
        store.open(extent_id.upper() if extent_id != extent_id.upper() else "A" * 32)
    assert store.delete(extent_id) is True
    with pytest.raises(ExtentNotFoundError):
        store.open(extent_id)
    assert store.delete(extent_id) is False


def test_not_found_is_a_storage_error() -> None:
    assert issubclass(ExtentNotFoundError, StorageError)
    assert issubclass(ShortReadError, StorageError)


def test_extent_ids_are_random_hex(store: BlockStore) -> None:
    ids = [_put(store, b"same bytes every time") for _ in range(200)]
    assert all(ID_RE.fullmatch(i) for i in ids)
    assert len(set(ids)) == len(ids)
    # Ids spread over the shard space (random, not sequential): 200 uniform draws over 256
    # shards hit ~140 of them; a counter or timestamp would hit a handful.
    assert len({i[:2] for i in ids}) >= 64
    assert sorted(store.list()) == sorted(ids)


def test_ids_are_not_reused_after_delete(store: BlockStore) -> None:
    seen: set[str] = set()
    for _ in range(50):
        extent_id = _put(store, b"x")
        assert extent_id not in seen
        seen.add(extent_id)
        assert store.delete(extent_id) is True
    assert list(store.list()) == []


def test_list_ignores_foreign_files(local_store: LocalBlockStore) -> None:
    extent_id = _put(local_store, b"real")
    (local_store.extent_dir / "stray.txt").write_text("x")
    shard = local_store.extent_dir / "ab"
    shard.mkdir(exist_ok=True)
    (shard / "not-an-id.tkx").write_text("x")
    (shard / ("ab" * 16 + ".part")).write_text("x")
    (shard / ("AB" * 16 + ".tkx")).write_text("x")
    assert list(local_store.list()) == [extent_id]


def test_sweep_temporary_removes_leftover_parts(local_store: LocalBlockStore) -> None:
    keep = _put(local_store, b"committed")
    # Leftovers of "crashed" writers: a real writer's file and hand-made ones.
    abandoned = local_store.create()
    abandoned.write(b"half")
    for i in range(3):
        (local_store.temp_dir / f"{i:032x}.part").write_bytes(b"partial")
    other = local_store.temp_dir / "notes.txt"
    other.write_text("not a part file")
    assert len(_parts(local_store)) == 4

    assert local_store.sweep_temporary() == 4
    assert _parts(local_store) == []
    assert other.exists()  # only .part files are swept
    assert list(local_store.list()) == [keep]
    assert _read_all(local_store, keep) == b"committed"
    assert local_store.sweep_temporary() == 0
    # The swept writer can no longer publish anything.
    with pytest.raises(StorageError):
        abandoned.commit()
    assert list(local_store.list()) == [keep]


def test_extent_files_are_private(local_store: LocalBlockStore) -> None:
    writer = local_store.create()
    writer.write(b"secret-ish")
    (part,) = _parts(local_store)
    assert stat.S_IMODE(part.stat().st_mode) == 0o600
    extent_id = writer.commit()
    assert stat.S_IMODE(local_store.path_of(extent_id).stat().st_mode) == 0o600


def test_reopened_store_sees_committed_extents(tmp_path: Path) -> None:
    root = tmp_path / "blocks"
    first = LocalBlockStore(root, durable=False)
    a = _put(first, b"alpha")
    b = _put(first, b"beta")
    first.close()
    second = LocalBlockStore(root, durable=False)
    assert sorted(second.list()) == sorted([a, b])
    assert _read_all(second, a) == b"alpha"
    assert _read_all(second, b) == b"beta"


def test_durable_store_round_trip(tmp_path: Path) -> None:
    store = LocalBlockStore(tmp_path / "durable")
    assert store.durable is True
    data = os.urandom(10_000)
    with store.create() as writer:
        writer.write(data[:5000])
        writer.write(data[5000:])
        extent_id = writer.commit()
    assert list(store.list()) == [extent_id]
    assert _parts(store) == []
    assert stat.S_IMODE(store.path_of(extent_id).stat().st_mode) == 0o600
    assert _read_all(store, extent_id) == data
    with pytest.raises(RuntimeError), store.create() as writer:
        writer.write(b"x")
        raise RuntimeError
    assert list(store.list()) == [extent_id]
    assert store.delete(extent_id) is True
    assert list(store.list()) == []


def test_write_at_from_many_threads_assembles_the_extent(store: BlockStore) -> None:
    parts = [os.urandom(4096 + i) for i in range(16)]
    offsets = [sum(len(p) for p in parts[:i]) for i in range(len(parts))]
    with store.create() as writer, ThreadPoolExecutor(4) as pool:
        # Out of order and concurrently: each part lands at its own offset.
        list(pool.map(writer.write_at, reversed(offsets), reversed(parts)))
        extent_id = writer.commit()
    assert _read_all(store, extent_id) == b"".join(parts)


def test_write_at_after_abort_raises_and_leaves_nothing(local_store: LocalBlockStore) -> None:
    writer = local_store.create()
    writer.write_at(10, b"tail")
    writer.abort()
    with pytest.raises(StorageError):
        writer.write_at(0, b"head")
    assert list(local_store.list()) == [] and _parts(local_store) == []


# Regions of an extent: (gap before, length, how the bytes are handed over), laid out one after
# another. Lengths cross 4 KiB page boundaries, gaps leave holes, and the three ways of passing
# bytes take the direct writer's three paths (page-placed scratch memory, unaligned writable
# memory through the bounce buffer, read-only bytes).
_REGIONS = st.lists(
    st.tuples(
        st.integers(0, 5000),
        st.integers(0, 3 * 4096 + 100),
        st.sampled_from(["scratch", "bytearray", "bytes"]),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(regions=_REGIONS, seed=st.integers(0, 2**32 - 1))
def test_direct_writes_give_the_bytes_of_plain_writes(
    tmp_path_factory: pytest.TempPathFactory, regions: list[tuple[int, int, str]], seed: int
) -> None:
    """O_DIRECT writes (whole pages direct, the pieces of partly covered pages buffered)
    produce the same file as plain pwrite: bytes where regions were written, zeros in holes, and
    the size of the furthest region. The plain writer is the positive control of the
    comparison."""
    rng = random.Random(seed)
    root = tmp_path_factory.mktemp("direct")
    direct = LocalBlockStore(root / "direct", durable=True, direct=True)
    plain = LocalBlockStore(root / "plain", durable=False, direct=False)
    assert direct.direct and not plain.direct
    placed, offset = [], 0
    for gap, length, how in regions:
        offset += gap
        placed.append((offset, rng.randbytes(length), how))
        offset += length
    # An empty write does not extend a file (pwrite of nothing), so only written bytes count.
    expected = bytearray(max((start + len(data) for start, data, _ in placed if data), default=0))
    for start, data, _ in placed:
        expected[start : start + len(data)] = data
    ids = []
    for store in (direct, plain):
        with store.create() as writer, ThreadPoolExecutor(3) as pool:

            def put(item: tuple[int, bytes, str], writer: ExtentWriter = writer) -> None:
                start, data, how = item
                if how == "scratch":
                    buffer = writer.scratch(start, len(data))
                    buffer[:] = data
                    writer.write_at(start, buffer)
                elif how == "bytearray":
                    writer.write_at(start, memoryview(bytearray(b"\0" + data))[1:])
                else:
                    writer.write_at(start, data)

            list(pool.map(put, reversed(placed)))  # out of order and concurrently
            ids.append(writer.commit())
    assert direct.direct, "the file system refused O_DIRECT: the direct path went untested"
    assert _read_all(direct, ids[0]) == bytes(expected)
    assert _read_all(plain, ids[1]) == bytes(expected)


def test_durable_stores_write_direct_and_can_opt_out(tmp_path: Path) -> None:
    assert LocalBlockStore(tmp_path / "a").direct is True
    assert LocalBlockStore(tmp_path / "b", direct=False).direct is False
    assert LocalBlockStore(tmp_path / "c", durable=False).direct is False
    # Mapped loads are the default only for extents written through the page cache.
    assert LocalBlockStore(tmp_path / "d").map_reads is False
    assert LocalBlockStore(tmp_path / "e", direct=False).map_reads is True  # ext4/tmpfs here


def test_a_file_system_that_refuses_o_direct_gets_buffered_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tmpfs and some FUSE mounts refuse O_DIRECT at open: the store falls back to buffered
    writes, with the same bytes, once, and says so."""
    store = LocalBlockStore(tmp_path / "blocks", direct=True)
    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    data = os.urandom(3 * 4096 + 17)
    with store.create() as writer:
        writer.write_at(5, data)
        extent_id = writer.commit()
    monkeypatch.undo()
    assert store.direct is False
    with store.open(extent_id) as reader:
        buffer = bytearray(reader.size)
        reader.readinto(0, [buffer])
    assert bytes(buffer) == bytes(5) + data


@pytest.mark.parametrize("direct", [True, False])
def test_reserve_allocates_but_the_writes_decide_the_size(tmp_path: Path, direct: bool) -> None:
    """A reserved extent (fallocate with direct writes) still ends where its furthest write
    ends: reserving more than is written leaves no zero tail, and a store with nothing but a
    reservation is empty."""
    store = LocalBlockStore(tmp_path / "blocks", durable=True, direct=direct)
    data = os.urandom(2 * 4096 + 100)
    with store.create() as writer:
        writer.reserve(10 * 4096)
        writer.write_at(3, data)
        extent_id = writer.commit()
    assert _read_all(store, extent_id) == bytes(3) + data
    with store.create() as writer:
        writer.reserve(4096)
        empty = writer.commit()
    assert _read_all(store, empty) == b""
