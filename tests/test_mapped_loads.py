"""Loads that decrypt straight out of mapped extents (``map_reads``), against loads that read
them into staging first: the same bytes, the same integrity checks, the same handles."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tenantkv
from tenantkv import KVLayout, TenantKV
from tenantkv.datapath import chunk_io
from tenantkv.datapath.extent_format import HEADER_BYTES
from tenantkv.datapath.worker_hold import FirstLayerHold
from tenantkv.storage import LocalBlockStore
from tenantkv.storage import local as local_module
from tenantkv.storage.local import MAPPED_SEGMENT_BYTES, file_system_type
from tests.helpers import layers_equal, load_all, random_layers, random_tokens
from tests.indexes import Index

MLA = KVLayout.mla(3, kv_lora_rank=48, rope_dim=16, dtype=torch.bfloat16)
MHA = KVLayout.mha(2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
TOKENS = 5 * 64


@pytest.fixture(params=[True, False], ids=["mapped", "staged"])
def map_reads(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def cache(tmp_path: Path, index: Index, map_reads: bool) -> TenantKV:
    kv = tenantkv.open(tmp_path / "cache", durable=False, map_reads=map_reads)
    kv.create_tenant("acme")
    yield kv
    kv.close()


def _extent_files(root: Path) -> list[Path]:
    return sorted((root / "blocks" / "extents").glob("*/*.tkx"))


def _flip_bit(root: Path, *, layer: int, block: int) -> None:
    """Flip one ciphertext bit of segment (``block``, ``layer``) of the cache's one MLA extent."""
    (path,) = _extent_files(root)
    data = bytearray(path.read_bytes())
    sealed = 64 * MLA.token_bytes + 16
    data[32 + sealed * (TOKENS // 64 * layer + block) + 100] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_store_maps_only_when_asked(tmp_path: Path) -> None:
    data = os.urandom(3 * 4096 + 5)
    for map_reads in (True, False):
        store = LocalBlockStore(tmp_path / str(map_reads), durable=False, map_reads=map_reads)
        with store.create() as writer:
            writer.write(data)
            extent_id = writer.commit()
        with store.open(extent_id) as reader:
            view = reader.mapped()
            if map_reads:
                assert view is not None and bytes(view) == data
                reader.done_with(4096, 8192)  # drops resident pages, never the bytes
                assert bytes(view[4000:12300]) == data[4000:12300]
                del view
            else:
                assert view is None
            buffer = bytearray(len(data) - 7)
            reader.readinto(7, [buffer])
            assert bytes(buffer) == data[7:]
        store.close()


def test_the_default_maps_on_local_file_systems_only(tmp_path: Path) -> None:
    kind = file_system_type(tmp_path)
    assert kind, "/proc/self/mountinfo names the file system of the test's directory"
    store = LocalBlockStore(tmp_path / "blocks", durable=False)
    local = kind in {"ext4", "xfs", "btrfs", "tmpfs", "overlay", "f2fs", "ext3", "ext2"}
    assert store.map_reads is local
    assert file_system_type(Path("/proc/self")) == "proc"  # not a file system one may map


@pytest.mark.parametrize("layout", [MLA, MHA], ids=["mla", "mha"])
@pytest.mark.parametrize("mode", ["fresh", "out", "paged"])
def test_loads_return_the_stored_bytes(
    cache: TenantKV, layout: KVLayout, mode: str, map_reads: bool
) -> None:
    ns = cache.namespace("acme", model="m", layout=layout)
    tokens = random_tokens(TOKENS, seed=3)
    want = random_layers(layout, TOKENS, seed=4)
    assert ns.store(tokens, want) == TOKENS
    if mode == "fresh":
        got = load_all(ns, tokens)
        assert all(layers_equal(a, b) for a, b in zip(got, want, strict=True))
        return
    blocks = TOKENS // 64
    # paged: blocks land in reversed 64-row pages of a larger buffer, with a gap page
    rows = [64 * (blocks - b) for b in range(blocks)] if mode == "paged" else None
    capacity = 64 * (blocks + 1)

    def empty() -> torch.Tensor:
        if layout.kind == "mla":
            return torch.full((capacity, layout.values_per_token), 7.0, dtype=layout.dtype)
        return torch.full((capacity, layout.num_kv_heads, layout.head_dim), 7.0, dtype=layout.dtype)

    out = [
        empty() if layout.kind == "mla" else (empty(), empty()) for _ in range(layout.num_layers)
    ]
    with ns.load(tokens, out=out, block_rows=rows) as stream:
        for index, layer in stream:
            assert layer is out[index]
    for index, layer in enumerate(want):
        parts = [layer] if isinstance(layer, torch.Tensor) else list(layer)
        buffers = [out[index]] if layout.kind == "mla" else list(out[index])
        for part, buffer in zip(parts, buffers, strict=True):
            for b in range(blocks):
                at = rows[b] if rows is not None else 64 * b
                assert torch.equal(buffer[at : at + 64], part[64 * b : 64 * (b + 1)])
        if rows is not None:  # the page no block maps to is untouched
            assert all(bool((buffer[:64] == 7.0).all()) for buffer in buffers)


def test_a_flipped_ciphertext_bit_fails_to_open(cache: TenantKV, tmp_path: Path) -> None:
    ns = cache.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(TOKENS, seed=5)
    want = random_layers(MLA, TOKENS, seed=6)
    ns.store(tokens, want)
    assert all(layers_equal(a, b) for a, b in zip(load_all(ns, tokens), want, strict=True))
    _flip_bit(tmp_path / "cache", layer=1, block=0)
    with pytest.raises(tenantkv.SegmentIntegrityError) as caught, ns.load(tokens) as stream:
        for _ in stream:
            pass
    assert caught.value.delivered_layers == 1
    assert ns.lookup(tokens) == 0  # the damaged prefix was dropped


def test_an_extent_unlinked_during_a_load_still_loads(cache: TenantKV, tmp_path: Path) -> None:
    # Deleting an extent is an unlink: a load that has it open (mapped or not) reads it whole.
    ns = cache.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(TOKENS, seed=7)
    want = random_layers(MLA, TOKENS, seed=8)
    ns.store(tokens, want)
    got = []
    with ns.load(tokens) as stream:
        for index, layer in stream:
            if index == 0:
                for path in _extent_files(tmp_path / "cache"):
                    path.unlink()
            got.append(layer)
    assert all(layers_equal(a, b) for a, b in zip(got, want, strict=True))


def _slow_workers(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Make chunks opened off the calling thread slow, so the caller, waiting for layer 0,
    finds chunks of it untaken; return the set of threads that opened chunks."""
    caller = threading.get_ident()
    opened: set[int] = set()
    open_chunk = chunk_io.ChunkOpener.open

    def recording(opener: Any, *args: Any, **kw: Any) -> Any:
        opened.add(threading.get_ident())
        if threading.get_ident() != caller:
            time.sleep(0.04)
        return open_chunk(opener, *args, **kw)

    monkeypatch.setattr(chunk_io.ChunkOpener, "open", recording)
    return opened


def test_the_caller_opens_chunks_of_the_layer_it_waits_for(
    cache: TenantKV, map_reads: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = cache.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(TOKENS, seed=9)
    want = random_layers(MLA, TOKENS, seed=10)
    ns.store(tokens, want)
    opened = _slow_workers(monkeypatch)
    got = load_all(ns, tokens)
    assert all(layers_equal(a, b) for a, b in zip(got, want, strict=True))
    # Mapped reads into fresh layers need no staging slot: the caller helps (and on a busy
    # machine may open every chunk before a worker starts). Staged reads need one, which only
    # workers hold: the caller waits, and workers open every chunk.
    caller = threading.get_ident()
    if map_reads:
        assert caller in opened
    else:
        assert opened and caller not in opened


def test_the_caller_does_not_open_chunks_that_need_a_staging_slot(
    cache: TenantKV, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MHA out= buffers keep k and v apart: chunks are decrypted into a staging slot and copied
    # out, and only workers hold slots.
    ns = cache.namespace("acme", model="m", layout=MHA)
    tokens = random_tokens(TOKENS, seed=13)
    want = random_layers(MHA, TOKENS, seed=14)
    ns.store(tokens, want)
    opened = _slow_workers(monkeypatch)
    out = [
        tuple(torch.empty(TOKENS, MHA.num_kv_heads, MHA.head_dim, dtype=MHA.dtype) for _ in "kv")
        for _ in range(MHA.num_layers)
    ]
    with ns.load(tokens, out=out) as stream:
        got = [layer for _, layer in stream]
    assert all(layers_equal(a, b) for a, b in zip(got, want, strict=True))
    assert opened and threading.get_ident() not in opened


def test_a_damaged_chunk_the_caller_opens_fails_the_load(
    cache: TenantKV, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = cache.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(TOKENS, seed=11)
    ns.store(tokens, random_layers(MLA, TOKENS, seed=12))
    (path,) = _extent_files(tmp_path / "cache")
    data = bytearray(path.read_bytes())
    sealed = 64 * MLA.token_bytes + 16
    for block in range(TOKENS // 64):  # every block of layer 0: whoever opens one, it fails
        data[32 + sealed * block + 7] ^= 0x80
    path.write_bytes(bytes(data))
    _slow_workers(monkeypatch)
    with pytest.raises(tenantkv.SegmentIntegrityError) as caught, ns.load(tokens) as stream:
        stream.wait_for_layer(0)
    assert caught.value.delivered_layers == 0
    assert ns.lookup(tokens) == 0


# ---- segments opened in groups (the opt-in hold: a caller woken for layer 0 gets the GIL) ----


def _hold_workers(kv: TenantKV, segments: int) -> None:
    """Opt ``kv``'s loads in to the hold (``worker_hold.py``), opening ``segments`` at a time."""
    kv.context.runtime.load_executor.first_layer_hold = FirstLayerHold(segments=segments)


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("layout", [MLA, MHA], ids=["mla", "mha"])
def test_chunks_opened_in_groups_of_segments_load_the_stored_bytes(
    cache: TenantKV, layout: KVLayout, group: int
) -> None:
    """Groups smaller than every chunk: each chunk is opened group by group (the last group
    short where the count does not divide), and the bytes are the stored ones."""
    _hold_workers(cache, group)
    ns = cache.namespace("acme", model="m", layout=layout)
    tokens = random_tokens(TOKENS, seed=15)
    want = random_layers(layout, TOKENS, seed=16)
    ns.store(tokens, want)
    got = load_all(ns, tokens)
    assert all(layers_equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_flipped_bit_in_a_later_group_fails_to_open(cache: TenantKV, tmp_path: Path) -> None:
    _hold_workers(cache, 2)
    ns = cache.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(TOKENS, seed=17)
    want = random_layers(MLA, TOKENS, seed=18)
    ns.store(tokens, want)
    assert all(layers_equal(a, b) for a, b in zip(load_all(ns, tokens), want, strict=True))
    _flip_bit(tmp_path / "cache", layer=1, block=TOKENS // 64 - 1)  # layer 1's last block
    with pytest.raises(tenantkv.SegmentIntegrityError) as caught, ns.load(tokens) as stream:
        for _ in stream:
            pass
    assert caught.value.delivered_layers == 1


class _RecordingCipher:
    def __init__(self, log: list[tuple[str, int, int]]) -> None:
        self.log = log

    def open_many_into(
        self, first: int, layer: int, keys: Any, sealed: memoryview, outs: list[Any]
    ) -> None:
        assert len(keys) == len(outs) and len(sealed) == len(outs) * 10
        self.log.append(("open", first, len(outs)))


class _Caller:
    """Whether workers are held for a caller (a deadline, or None), as the stream keeps it;
    a pause is the caller coming back for a later layer, which ends the hold."""

    def __init__(self, log: list[tuple[str, int, int]], held_until: float | None) -> None:
        self.log = log
        self.held_until = held_until
        self.policy = FirstLayerHold(segments=2)

    def pause(self, layer: int) -> None:
        now = time.monotonic()
        wait = self.policy.pause_s(
            layer=layer, held_until=self.held_until, now=now, waiting_tasks=0
        )
        if wait > 0:
            assert wait <= self.policy.handover_s
            self.log.append(("pause", 0, 0))
            self.held_until = None


class _HoldingCipher(_RecordingCipher):
    """Opens like ``_RecordingCipher``; workers are held for a caller after its first group
    (layer 0 completed for a blocked caller while this worker opened a chunk of layer 1)."""

    def __init__(self, log: list[tuple[str, int, int]], caller: _Caller) -> None:
        super().__init__(log)
        self.caller = caller

    def open_many_into(
        self, first: int, layer: int, keys: Any, sealed: memoryview, outs: list[Any]
    ) -> None:
        super().open_many_into(first, layer, keys, sealed, outs)
        if len(self.log) == 1:
            self.caller.held_until = time.monotonic() + self.caller.policy.handover_s


@pytest.mark.parametrize("case", ["free", "held", "held after a group", "hold expired"])
def test_workers_pause_between_groups_only_while_held_for_a_caller(case: str) -> None:
    """While workers are held for a caller blocked on layer 0 (and the hold's bound has not
    passed), a worker pauses before its next group of segments of a later layer until the
    caller comes back; otherwise it opens its chunk group after group without a pause."""
    log: list[tuple[str, int, int]] = []
    bound = FirstLayerHold().handover_s
    held_until = {
        "free": None,
        "held": time.monotonic() + bound,
        "held after a group": None,
        "hold expired": time.monotonic() - 1.0,
    }[case]
    caller = _Caller(log, held_until)
    cipher = _HoldingCipher(log, caller) if case == "held after a group" else _RecordingCipher(log)
    # 5 segments of 10 sealed bytes, from slot 7 of layer 1: groups of 2, 2 and 1
    work = SimpleNamespace(chunk=SimpleNamespace(slot=7), keys=[b"k"] * 5)
    chunk_io.open_segments(
        cipher,  # type: ignore[arg-type]
        1,
        work,  # type: ignore[arg-type]
        memoryview(bytes(50)),
        [memoryview(bytearray(4))] * 5,
        group=caller.policy.segments,
        pause=caller.pause,
    )
    opens = [("open", 7, 2), ("open", 9, 2), ("open", 11, 1)]
    pause = ("pause", 0, 0)
    expected = {
        "free": opens,
        "held": [pause, *opens],
        "held after a group": [opens[0], pause, *opens[1:]],
        "hold expired": opens,
    }
    assert log == expected[case]


@pytest.mark.parametrize("backlog", [False, True])
def test_a_held_worker_does_not_pause_while_other_tasks_wait_for_its_thread(
    backlog: bool,
) -> None:
    """Held for a caller, a worker pauses (until the caller is back); but not while another
    load's task waits for a loader thread, which the paused worker would keep from it."""
    policy = FirstLayerHold()
    now = time.monotonic()
    pause = policy.pause_s(
        layer=1, held_until=now + policy.handover_s, now=now, waiting_tasks=int(backlog)
    )
    assert (pause > 0) is not backlog
    if not backlog:
        assert pause == pytest.approx(policy.handover_s)


@pytest.mark.usefixtures("index")
@pytest.mark.parametrize("direct_writes", [None, True, False])
def test_the_cache_passes_its_read_and_write_modes_to_the_store(
    tmp_path: Path, direct_writes: bool | None
) -> None:
    kv = tenantkv.open(tmp_path / "cache", map_reads=False, direct_writes=direct_writes)
    try:
        store = kv.context.blocks
        assert isinstance(store, LocalBlockStore)
        assert store.map_reads is False
        # None: O_DIRECT for a durable store (the default), which Linux has
        assert store.direct is (direct_writes is not False)
    finally:
        kv.close()
    with pytest.raises(tenantkv.InvalidRequestError, match="direct_writes"):
        tenantkv.open(tmp_path / "bad", direct_writes="yes")


# ---- extents written with O_DIRECT: mapped for large segments, once in the page cache ----------

#: 64 tokens of this layout are a 128 KiB segment: one a direct-written extent is mapped for
#: by default (at least ``MAPPED_SEGMENT_BYTES``).
LARGE_MHA = KVLayout.mha(2, num_kv_heads=4, head_dim=128, dtype=torch.float16)


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_direct_written_extents_are_mapped_for_large_segments_once_cached(
    tmp_path: Path,
) -> None:
    store = LocalBlockStore(tmp_path / "blocks")  # durable: O_DIRECT, no ring
    if not store.direct:
        pytest.skip("this file system refuses O_DIRECT")
    assert store.map_reads is False
    assert store.mapped_segment_bytes == MAPPED_SEGMENT_BYTES
    # Four regions of an odd size, as sealers write segments: the pages at each region's
    # edges go through the page cache, and the quarter, half and three-quarter marks of the
    # file fall in such pages.
    region = MAPPED_SEGMENT_BYTES + 16
    data = os.urandom(4 * region)
    with store.create() as writer:
        for start in range(0, len(data), region):
            writer.write_at(start, data[start : start + region])
        extent_id = writer.commit()
    path = store.path_of(extent_id)

    def mapped(segment_bytes: int) -> bytes | None:
        with store.open(extent_id) as reader:
            view = reader.mapped(segment_bytes)
            copy = None if view is None else bytes(view)
            del view
            buffer = bytearray(len(data))  # reads the same either way
            reader.readinto(0, [buffer])
            assert bytes(buffer) == data
        return copy

    # Written past the page cache: not mapped (a fault would read the device page by page),
    # although the edges of the written regions went through the page cache.
    assert mapped(MAPPED_SEGMENT_BYTES) is None
    # The reads above brought it into the page cache: large segments are mapped now...
    assert mapped(MAPPED_SEGMENT_BYTES) == data
    # ... small ones never, and not once the page cache has dropped it.
    assert mapped(MAPPED_SEGMENT_BYTES - 1) is None
    assert mapped(0) is None
    _evict(path)
    assert mapped(MAPPED_SEGMENT_BYTES) is None
    store.close()
    # Asked not to map, the store maps nothing, cached or not.
    unmapped = LocalBlockStore(tmp_path / "blocks", map_reads=False)
    assert unmapped.mapped_segment_bytes is None
    with unmapped.open(extent_id) as reader:
        assert reader.mapped(10 * MAPPED_SEGMENT_BYTES) is None
    unmapped.close()


def test_the_segments_of_common_layouts_are_mapped_by_default() -> None:
    """The bound sits below a DeepSeek-V3 latent's 64-token block (72 KiB) and an MHA block of
    64 KiB (32 tokens of 4 fp32 heads of 64, vLLM's CPU benchmark), both read faster mapped on
    the Xeon VM (docs/perf.md, "A faster Xeon VM"; not on an AMD EPYC VM: "Mapped segments on
    an AMD EPYC VM"); an 8 KiB segment is not."""
    latent = KVLayout.mla(61, kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    assert latent.segment_bytes(64) == 72 * 1024 >= MAPPED_SEGMENT_BYTES
    vllm_cpu = KVLayout.mha(8, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    assert vllm_cpu.segment_bytes(32) == 64 * 1024 >= MAPPED_SEGMENT_BYTES
    assert MHA.segment_bytes(64) == 8 * 1024 < MAPPED_SEGMENT_BYTES


@pytest.mark.parametrize("mode", ["fresh", "out"])
def test_a_durable_cache_maps_large_segments_from_the_second_load(
    tmp_path: Path, index: Index, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers: list[bool] = []
    mapped = local_module._LocalReader.mapped

    def recording(reader: Any, segment_bytes: int = 0) -> memoryview | None:
        view = mapped(reader, segment_bytes)
        answers.append(view is not None)
        return view

    monkeypatch.setattr(local_module._LocalReader, "mapped", recording)
    kv = tenantkv.open(tmp_path / "cache", recent_writes_bytes=0)  # durable, O_DIRECT
    try:
        store = kv.context.blocks
        assert isinstance(store, LocalBlockStore)
        if not store.direct:
            pytest.skip("this file system refuses O_DIRECT")
        kv.create_tenant("acme")
        for layout, name in ((LARGE_MHA, "large"), (MHA, "small")):
            ns = kv.namespace("acme", model=name, layout=layout)
            tokens = random_tokens(TOKENS, seed=21)
            want = random_layers(layout, TOKENS, seed=22)
            assert ns.store(tokens, want) == TOKENS
            for _ in range(2):
                if mode == "fresh":
                    got = load_all(ns, tokens)
                else:
                    shape = (TOKENS, layout.num_kv_heads, layout.head_dim)
                    got = [
                        (
                            torch.zeros(shape, dtype=layout.dtype),
                            torch.zeros(shape, dtype=layout.dtype),
                        )
                        for _ in range(layout.num_layers)
                    ]
                    with ns.load(tokens, out=got) as stream:
                        for _ in stream:
                            pass
                assert all(layers_equal(a, b) for a, b in zip(got, want, strict=True))
        # large segments: the first load read the device (staged), the second mapped the
        # page cache; small segments (8 KiB) were read staged both times
        assert answers == [False, True, False, False]
    finally:
        kv.close()


# ---- mapped spans dropped from the process in batches ---------------------------------------


def test_merged_joins_spans_that_touch_or_overlap() -> None:
    merged = chunk_io.merged_spans
    assert merged([]) == []
    assert merged([(10, 20), (0, 10), (30, 40), (15, 25)]) == [(0, 25), (30, 40)]
    assert merged([(5, 6)]) == [(5, 6)]


# Chunks are back to back in an extent: on a coarse grid, spans often touch.
_SPANS = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 4)), max_size=12)


@given(_SPANS)
def test_merged_spans_cover_exactly_what_the_spans_cover(pieces: list[tuple[int, int]]) -> None:
    spans = [(5 * start, 5 * (start + length)) for start, length in pieces]
    merged = chunk_io.merged_spans(spans)
    covered = {i for start, end in spans for i in range(start, end)}  # the model: a set
    assert {i for start, end in merged for i in range(start, end)} == covered
    # sorted, and apart: two spans that touched would have been one
    assert all(end < start for (_, end), (start, _) in itertools.pairwise(merged))
    assert all(start < end for start, end in merged)


@pytest.mark.parametrize("batch", ["per chunk", "two chunks", "never"])
def test_a_mapped_load_drops_what_it_opened_in_batches(
    tmp_path: Path, index: Index, batch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = tenantkv.open(tmp_path / "cache", durable=False, map_reads=True)
    try:
        kv.create_tenant("acme")
        ns = kv.namespace("acme", model="m", layout=MLA)
        tokens = random_tokens(TOKENS, seed=31)
        want = random_layers(MLA, TOKENS, seed=32)
        assert ns.store(tokens, want) == TOKENS
        segment = 64 * MLA.token_bytes + 16
        segments = TOKENS // 64 * MLA.num_layers * segment  # the extent's bytes after its header
        threshold = {"per chunk": 1, "two chunks": 2 * 5 * segment, "never": segments + 1}[batch]
        monkeypatch.setattr(chunk_io, "MAPPED_DROP_BYTES", threshold)
        dropped: list[tuple[int, int]] = []
        opened: list[int] = []
        done_with = local_module._LocalReader.done_with
        open_chunk = chunk_io.ChunkOpener.open

        def recording(reader: Any, offset: int, length: int) -> None:
            dropped.append((offset, offset + length))
            done_with(reader, offset, length)

        def counting(opener: Any, layer: int, work: Any, *args: Any, **kw: Any) -> Any:
            opened.append(work.size)
            return open_chunk(opener, layer, work, *args, **kw)

        monkeypatch.setattr(local_module._LocalReader, "done_with", recording)
        monkeypatch.setattr(chunk_io.ChunkOpener, "open", counting)
        got = load_all(ns, tokens)
        assert all(layers_equal(a, b) for a, b in zip(got, want, strict=True))
    finally:
        kv.close()
    assert sum(opened) == segments  # every segment opened once, out of the mapping
    spans = sorted(dropped)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))  # no overlaps
    total = sum(end - start for start, end in spans)
    if batch == "per chunk":  # each chunk dropped on its own: together, every segment
        assert len(dropped) == len(opened) > MLA.num_layers
        assert spans[0][0] == HEADER_BYTES and spans[-1][1] == HEADER_BYTES + segments
        assert total == segments
    elif batch == "two chunks":  # fewer drops; what is left under a batch goes at close
        assert 0 < len(dropped) < len(opened)
        assert segments - threshold < total <= segments
    else:
        assert dropped == []
