"""The streaming loader: order, exactness, caller buffers, a shared bounded ring, clean cancel."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tenantkv
from tenantkv import KVLayout, TenantKV
from tenantkv.datapath import chunk_io, load_workers
from tenantkv.datapath.worker_hold import FirstLayerHold
from tests.helpers import layers_equal, load_all, prefix_of, random_layers, random_tokens
from tests.indexes import Index

MLA = KVLayout.mla(4, kv_lora_rank=48, rope_dim=16, dtype=torch.bfloat16)  # 8 KiB segments
MHA = KVLayout.mha(3, num_kv_heads=2, head_dim=16, dtype=torch.float16)  # 8 KiB segments
SEGMENT = 64 * MLA.token_bytes + 16


def _open_fds() -> int:
    """File handles this process holds on extent files (index connections come and go)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target.endswith(".tkx")
    return count


def _threads_outside_pools(kv: TenantKV) -> int:
    """Live threads other than the cache's pool threads, which may start on demand (up to
    ``load_threads``, and the one bookkeeping thread) and live as long as the cache; a stream
    must leave no other behind."""
    runtime = kv.context.runtime
    assert len(runtime.load_executor._threads) <= runtime.load_threads
    assert len(runtime.bookkeeping_executor._threads) <= 1
    pooled = {
        *runtime.load_executor._threads,
        *runtime.seal_executor._threads,
        *runtime.bookkeeping_executor._threads,
    }
    return sum(thread not in pooled for thread in threading.enumerate())


@pytest.fixture
def small_ring(tmp_path: Path, index: Index) -> Iterator[TenantKV]:
    """A cache whose ring holds 3 slots of 2 segments for 4 loader threads: layers split into
    chunks, and threads wait for slots."""
    cache = tenantkv.open(
        tmp_path / "cache",
        durable=False,
        load_threads=4,
        staging_slot_bytes=2 * (SEGMENT + 64 * MLA.token_bytes),
        staging_bytes=3 * 2 * (SEGMENT + 64 * MLA.token_bytes),
    )
    try:
        yield cache
    finally:
        cache.close()


@pytest.mark.parametrize("layout", [MLA, MHA], ids=["mla", "mha"])
def test_layers_arrive_in_order_and_exact_through_a_tiny_ring(
    small_ring: TenantKV, layout: KVLayout
) -> None:
    small_ring.create_tenant("acme")
    ns = small_ring.namespace("acme", model="m", layout=layout)
    tokens = random_tokens(11 * 64)
    layers = random_layers(layout, len(tokens))
    ns.store(tokens[: 5 * 64], [prefix_of(layer, 5 * 64) for layer in layers])
    ns.store(tokens, layers)  # the prefix spans two extents
    loaded = load_all(ns, tokens)  # load_all checks the order
    for got, want in zip(loaded, layers, strict=True):
        assert layers_equal(got, want)
    stats = small_ring.staging_stats()["host"]
    assert stats.in_use == 0
    assert stats.peak_in_use <= stats.slots == 3


def test_out_buffers_are_filled_in_place(kv: TenantKV) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(3 * 64)
    layers = random_layers(MLA, len(tokens))
    ns.store(tokens, layers)
    out = [torch.full((5 * 64, MLA.values_per_token), 7.0, dtype=MLA.dtype) for _ in layers]
    pointers = [buffer.data_ptr() for buffer in out]
    with ns.load(tokens, out=out) as stream:
        for index, layer in stream:
            assert layer is out[index]
    for index, buffer in enumerate(out):
        assert buffer.data_ptr() == pointers[index]
        assert torch.equal(buffer[: len(tokens)], layers[index])  # type: ignore[arg-type]
        assert bool((buffer[len(tokens) :] == 7.0).all()), "rows past the load were touched"


def test_out_buffers_at_paged_block_rows(kv: TenantKV) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MHA)
    tokens = random_tokens(4 * 64, seed=3)
    layers = random_layers(MHA, len(tokens), seed=3)
    ns.store(tokens, layers)
    block_rows = [320, 0, 640, 128]  # blocks land on scattered 64-row pages
    shape = (12 * 64, MHA.num_kv_heads, MHA.head_dim)
    out = [
        (torch.zeros(shape, dtype=MHA.dtype), torch.zeros(shape, dtype=MHA.dtype)) for _ in layers
    ]
    with ns.load(tokens, out=out, block_rows=block_rows) as stream:
        for index, layer in stream:
            assert layer is out[index]
    for (k_out, v_out), (k, v) in zip(out, layers, strict=True):  # type: ignore[misc]
        written = torch.zeros(shape[0], dtype=torch.bool)
        for block, row in enumerate(block_rows):
            rows = slice(block * 64, block * 64 + 64)
            assert torch.equal(k_out[row : row + 64], k[rows])
            assert torch.equal(v_out[row : row + 64], v[rows])
            written[row : row + 64] = True
        assert bool((k_out[~written] == 0).all()) and bool((v_out[~written] == 0).all())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda out: out[:-1], "buffers"),
        (lambda out: [b.to(torch.float16) for b in out], "dtype"),
        (lambda out: [b[:, :-1] for b in out], "shape"),
        (lambda out: [b[:100] for b in out], "rows"),
        (lambda out: [b.t().contiguous().t() for b in out], "contiguous"),
        (lambda out: [out[0]] * len(out), "shares memory"),
        (lambda out: out[0], "sequence"),
    ],
    ids=["count", "dtype", "shape", "rows", "contiguous", "aliased", "not-a-list"],
)
def test_bad_out_buffers_are_refused_before_anything_opens(
    kv: TenantKV, change: object, match: str
) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(128)
    ns.store(tokens, random_layers(MLA, 128))
    good = [torch.empty(128, MLA.values_per_token, dtype=MLA.dtype) for _ in range(MLA.num_layers)]
    fds = _open_fds()
    with pytest.raises(tenantkv.InvalidRequestError, match=match):
        ns.load(tokens, out=change(good))  # type: ignore[operator]
    assert _open_fds() == fds
    with ns.load(tokens, out=good) as stream:  # positive control
        assert sum(1 for _ in stream) == MLA.num_layers


@pytest.mark.parametrize(
    ("block_rows", "match"),
    [([0], "entries"), ([0, 32], "overlap"), ([0, -64], "non-negative"), ([0, 4096], "rows")],
)
def test_bad_block_rows_are_refused(kv: TenantKV, block_rows: list[int], match: str) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(128)
    ns.store(tokens, random_layers(MLA, 128))
    out = [torch.empty(256, MLA.values_per_token, dtype=MLA.dtype) for _ in range(MLA.num_layers)]
    with pytest.raises(tenantkv.InvalidRequestError, match=match):
        ns.load(tokens, out=out, block_rows=block_rows)
    with pytest.raises(tenantkv.InvalidRequestError, match="needs out"):
        ns.load(tokens, block_rows=[0, 64])
    with ns.load(tokens, out=out, block_rows=[128, 0]) as stream:  # positive control
        assert sum(1 for _ in stream) == MLA.num_layers


def test_cancelling_mid_stream_leaves_nothing_behind(small_ring: TenantKV) -> None:
    small_ring.create_tenant("acme")
    layout = KVLayout.mla(12, kv_lora_rank=48, rope_dim=16, dtype=torch.bfloat16)
    ns = small_ring.namespace("acme", model="m", layout=layout)
    tokens = random_tokens(8 * 64)
    layers = random_layers(layout, len(tokens))
    ns.store(tokens, layers)
    load_all(ns, tokens)  # warm the pools up so their threads exist before counting
    threads, fds = _threads_outside_pools(small_ring), _open_fds()
    for stop_after in (0, 1, 5):
        with ns.load(tokens) as stream:
            assert _open_fds() == fds + 1  # positive control: the counter sees the extent
            for index, _ in stream:
                if index == stop_after:
                    break
        assert stream.closed
        assert small_ring.staging_stats()["host"].in_use == 0
        assert _open_fds() == fds
    stream = ns.load(tokens)
    stream.close()  # closing before reading anything
    assert _threads_outside_pools(small_ring) == threads
    assert _open_fds() == fds
    assert small_ring.staging_stats()["host"].in_use == 0
    for got, want in zip(load_all(ns, tokens), layers, strict=True):  # still works
        assert layers_equal(got, want)


def test_corruption_mid_stream_reports_delivered_layers_and_cleans_up(small_ring: TenantKV) -> None:
    small_ring.create_tenant("acme")
    layout = KVLayout.mla(6, kv_lora_rank=48, rope_dim=16, dtype=torch.bfloat16)
    ns = small_ring.namespace("acme", model="m", layout=layout)
    tokens = random_tokens(4 * 64)
    layers = random_layers(layout, len(tokens))
    ns.store(tokens, layers)
    load_all(ns, tokens)  # positive control, and warm pools
    threads, fds = _threads_outside_pools(small_ring), _open_fds()
    (extent_id,) = small_ring.context.blocks.list()
    path = small_ring.context.blocks.path_of(extent_id)  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[32 + (3 * 4 + 2) * SEGMENT + 100] ^= 0x01  # layer 3, block 2
    path.write_bytes(bytes(data))

    delivered: list[int] = []
    with pytest.raises(tenantkv.SegmentIntegrityError) as caught, ns.load(tokens) as stream:
        for index, layer in stream:
            assert torch.equal(layer, layers[index])  # type: ignore[arg-type]
            delivered.append(index)
    assert delivered == [0, 1, 2]
    assert caught.value.delivered_layers == 3
    assert small_ring.security_events() == {"segment_open_failed": 1}
    assert ns.lookup(tokens) == 0
    assert small_ring.staging_stats()["host"].in_use == 0
    assert _threads_outside_pools(small_ring) == threads
    assert _open_fds() == fds


@pytest.mark.usefixtures("index")
@pytest.mark.parametrize("map_reads", [False, True], ids=["staged", "mapped"])
def test_concurrent_loads_of_different_tenants_share_the_ring(
    tmp_path: Path, map_reads: bool
) -> None:
    # Two slots for eight loader threads: concurrent loads must queue for the ring -- when they
    # read into it (map_reads=False). Loads that decrypt straight out of mapped extents into
    # fresh layers need no slot at all, and must still give each tenant its own bytes.
    slot = 2 * (SEGMENT + 64 * MLA.token_bytes)
    small_ring = tenantkv.open(
        tmp_path / "shared",
        durable=False,
        map_reads=map_reads,
        load_threads=8,
        staging_slot_bytes=slot,
        staging_bytes=2 * slot,
    )
    tenants = [f"tenant{i}" for i in range(6)]
    data = {}
    for i, name in enumerate(tenants):
        small_ring.create_tenant(name)
        ns = small_ring.namespace(name, model="m", layout=MLA)
        # Each tenant's KV is a constant canary value, so a byte from another tenant shows.
        tokens = random_tokens(6 * 64, seed=100 + i)
        layers = [
            torch.full((len(tokens), MLA.values_per_token), float(i + 1), dtype=MLA.dtype)
            for _ in range(MLA.num_layers)
        ]
        ns.store(tokens, layers)
        data[name] = (ns, tokens, float(i + 1))
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(tenants))

    def load(name: str) -> None:
        ns, tokens, canary = data[name]
        try:
            barrier.wait()
            for _ in range(4):
                with ns.load(tokens) as stream:
                    for _, layer in stream:
                        assert bool((layer == canary).all()), f"{name} got another tenant's bytes"
        except BaseException as err:
            errors.append(err)

    # On a loaded host the six loads (each a few chunks) can run one after another, so for staged
    # reads the test takes both slots itself and gives them back only once a load is seen waiting:
    # the loads then contend for the ring for certain.
    ring = small_ring._ctx.runtime.staging_ring(pinned=False)
    never = threading.Event()
    held = [] if map_reads else [ring.acquire(never), ring.acquire(never)]
    workers = [threading.Thread(target=load, args=(name,)) for name in tenants]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 60.0
    while held and ring.stats().waits == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    waits_while_held = ring.stats().waits
    for slot in held:
        assert slot is not None
        ring.release(slot)
    for worker in workers:
        worker.join()
    assert not errors, errors
    stats = small_ring.staging_stats()["host"]
    small_ring.close()
    assert stats.in_use == 0
    if map_reads:
        assert stats.peak_in_use == 0, "mapped loads into fresh layers took staging slots"
        return
    assert stats.peak_in_use == stats.slots == 2
    assert waits_while_held > 0, "no load waited for the full ring: the loads bypassed it"


def _open_two_loader_threads(tmp_path: Path, slot_segments: int, **options: Any) -> TenantKV:
    """A cache whose loader pool has as many threads as one load runs workers (2), and a ring of
    4 slots of ``slot_segments`` sealed segments each."""
    return tenantkv.open(
        tmp_path / "cache",
        durable=False,
        workers=2,
        load_threads=2,
        staging_slot_bytes=slot_segments * SEGMENT,
        staging_bytes=4 * slot_segments * SEGMENT,
        **options,
    )


@pytest.fixture
def two_threads(tmp_path: Path, index: Index) -> Iterator[TenantKV]:
    """Two loader threads and a ring of 2-segment slots, so every layer is several chunks."""
    with _open_two_loader_threads(tmp_path, 2) as cache:
        yield cache


@pytest.fixture
def two_threads_held(tmp_path: Path, index: Index) -> Iterator[TenantKV]:
    """``two_threads`` with the hold opted in, and staged reads (the caller never opens a
    chunk itself: a worker completes layer 0 for it)."""
    with _open_two_loader_threads(
        tmp_path, 2, map_reads=False, hold_workers_for_first_layer=True
    ) as cache:
        yield cache


def _two_prefixes(kv: TenantKV) -> list[tuple[tenantkv.Namespace, list[int], list[Any]]]:
    layout = KVLayout.mla(12, kv_lora_rank=48, rope_dim=16, dtype=torch.bfloat16)
    stored = []
    for seed in (1, 2):
        kv.create_tenant(f"t{seed}")
        ns = kv.namespace(f"t{seed}", model="m", layout=layout)
        tokens = random_tokens(8 * 64, seed=seed)
        layers = random_layers(layout, len(tokens))
        ns.store(tokens, layers)
        stored.append((ns, tokens, layers))
    return stored


def test_a_stream_left_unconsumed_does_not_hold_up_another(two_threads: TenantKV) -> None:
    """Workers stop at the window instead of waiting in the pool's threads, so a stream whose
    caller is elsewhere cannot starve a later stream of loader threads."""
    (ns_a, tokens_a, layers_a), (ns_b, tokens_b, layers_b) = _two_prefixes(two_threads)
    with ns_a.load(tokens_a) as idle, ns_b.load(tokens_b) as busy:
        for index, layer in busy:
            assert layers_equal(layer, layers_b[index])
        for index, layer in idle:
            assert layers_equal(layer, layers_a[index])
    assert two_threads.staging_stats()["host"].in_use == 0


def test_streams_consumed_in_lockstep_share_the_loader_threads(two_threads: TenantKV) -> None:
    """Two loads on a pool with threads for one: their workers take turns chunk by chunk."""
    (ns_a, tokens_a, layers_a), (ns_b, tokens_b, layers_b) = _two_prefixes(two_threads)
    for _ in range(3):
        with ns_a.load(tokens_a) as a, ns_b.load(tokens_b) as b:
            for (i, got_a), (j, got_b) in zip(a, b, strict=True):
                assert i == j
                assert layers_equal(got_a, layers_a[i])
                assert layers_equal(got_b, layers_b[j])
    assert two_threads.staging_stats()["host"].in_use == 0


def test_waiting_for_a_layer_beyond_the_window_loads_up_to_it(two_threads: TenantKV) -> None:
    ((ns, tokens, layers), _) = _two_prefixes(two_threads)
    last = len(layers) - 1
    with ns.load(tokens) as stream:
        assert layers_equal(stream.wait_for_layer(last), layers[last])
        for index in (0, 5, 1, last):
            assert layers_equal(stream.wait_for_layer(index), layers[index])
        assert stream.delivered_layers == 2
    with pytest.raises(tenantkv.CacheClosedError):
        stream.wait_for_layer(0)


@pytest.fixture
def layer_sized_slots(tmp_path: Path, index: Index) -> Iterator[TenantKV]:
    """Two loader threads, a window of 2, and staged reads into slots that each hold a whole
    layer of an 8-block prefix."""
    with _open_two_loader_threads(tmp_path, 8, map_reads=False) as cache:
        yield cache


def _complete_layers_once_idle(stream: tenantkv.LoadStream) -> int:
    """How many layers ``stream`` completed once its workers left (the caller consumed none)."""
    deadline = time.monotonic() + 10
    while True:
        with stream._lock:
            schedule = stream._schedule
            if schedule.running == 0 and schedule.busy == 0:
                return sum(schedule.complete(i) for i in range(stream.num_layers))
        assert time.monotonic() < deadline, "the load's workers never left"
        time.sleep(0.005)


def test_an_out_load_opens_every_layer_without_waiting_for_its_caller(
    layer_sized_slots: TenantKV,
) -> None:
    """Into the caller's own buffers, a load allocates nothing ahead of its caller: no window
    holds its workers back (each would leave its thread and be started again per layer)."""
    ((ns, tokens, layers), _) = _two_prefixes(layer_sized_slots)
    out = [torch.empty_like(layer) for layer in layers]
    with ns.load(tokens, out=out) as stream:
        assert _complete_layers_once_idle(stream) == len(layers)
        for index, layer in stream:
            assert layer.data_ptr() == out[index].data_ptr()
            assert layers_equal(layer, layers[index])
    # Control: fresh layers stay within the window (2) of what the caller consumed.
    with ns.load(tokens) as fresh:
        assert _complete_layers_once_idle(fresh) == 2
        for index, layer in fresh:
            assert layers_equal(layer, layers[index])
    assert layer_sized_slots.staging_stats()["host"].in_use == 0


def test_a_caller_that_only_waits_for_layers_keeps_the_window_ahead_of_it(
    layer_sized_slots: TenantKV,
) -> None:
    """An engine's layer hooks call ``wait_for_layer(i)`` and never consume by iteration; the
    window (2) follows the layer they asked for, so the workers open the next layer while the
    caller computes, where counted from consumption alone they stopped two layers in and opened
    each later layer only once the caller was blocked on it (docs/perf.md, "Layer hooks: a
    read-ahead window that follows the caller")."""
    ((ns, tokens, layers), _) = _two_prefixes(layer_sized_slots)
    last = len(layers) - 1
    assert last >= 5
    with ns.load(tokens) as stream:
        assert _complete_layers_once_idle(stream) == 2  # 0 and 1: nothing asked for yet
        assert layers_equal(stream.wait_for_layer(3), layers[3])
        assert _complete_layers_once_idle(stream) == 5  # up to 3, and 4 ahead of the caller
        assert layers_equal(stream.wait_for_layer(4), layers[4])
        assert _complete_layers_once_idle(stream) == 6  # never more than the window ahead
        for index in range(last + 1):
            assert layers_equal(stream.wait_for_layer(index), layers[index])
    assert layer_sized_slots.staging_stats()["host"].in_use == 0


def test_an_out_load_opens_each_later_layer_in_one_chunk_a_slot_holds(
    layer_sized_slots: TenantKV,
) -> None:
    """Its workers each take a layer of their own: one chunk per later layer where a slot holds
    the layer, half as many reads, lock round trips and Python bookkeeping as a shared one."""
    ((ns, tokens, layers), _) = _two_prefixes(layer_sized_slots)
    out = [torch.empty_like(layer) for layer in layers]
    with ns.load(tokens, out=out) as stream:
        assert (len(stream._first_work), len(stream._work)) == (4, 1)
        for index, layer in stream:
            assert layers_equal(layer, layers[index])
    # Control: a fresh load, whose window holds workers back, shares each layer between them.
    with ns.load(tokens) as fresh:
        assert (len(fresh._first_work), len(fresh._work)) == (4, 2)
        for index, layer in fresh:
            assert layers_equal(layer, layers[index])


def test_window_and_cut_of_a_load() -> None:
    assert load_workers.later_layer_shares(61, 61, 8) == 1  # the window spans every layer
    assert load_workers.later_layer_shares(60, 61, 8) == 8
    assert load_workers.later_layer_shares(2, 61, 2) == 2


def _hold_workers(kv: TenantKV, policy: FirstLayerHold) -> None:
    """Opt ``kv``'s loads in to holding workers for a caller blocked on layer 0, by
    ``policy`` (``hold_workers_for_first_layer=True`` with bounds of the test's own)."""
    pool = kv.context.runtime.load_executor
    assert pool.first_layer_hold is not None  # opened with hold_workers_for_first_layer=True
    pool.first_layer_hold = policy


@pytest.fixture
def held(tmp_path: Path, index: Index) -> Iterator[TenantKV]:
    """A cache with the hold opted in and staged reads: chunks need a staging slot, so the
    caller never opens one itself, and a worker completes layer 0 for a blocked caller."""
    cache = tenantkv.open(
        tmp_path / "cache", durable=False, map_reads=False, hold_workers_for_first_layer=True
    )
    try:
        yield cache
    finally:
        cache.close()


def test_the_pause_after_layer_0_ends_when_the_caller_runs(held: TenantKV) -> None:
    """Workers are held while a blocked caller takes layer 0, until it comes back for another
    layer. With the bound raised to a minute, loads still finish at once: the caller, not the
    bound, ends the pause. (And workers were held: a positive control.)"""
    holds: list[float] = []

    class Recording(FirstLayerHold):
        def after_complete(self, *, layer: int, waiting_for: int, now: float) -> float | None:
            deadline = FirstLayerHold.after_complete(
                self, layer=layer, waiting_for=waiting_for, now=now
            )
            if deadline is not None:
                holds.append(round(deadline - now, 6))
            return deadline

    _hold_workers(held, Recording(handover_s=60.0))
    ((ns, tokens, layers), _) = _two_prefixes(held)
    started = time.monotonic()
    for _ in range(5):
        with ns.load(tokens) as stream:
            assert layers_equal(stream.wait_for_layer(0), layers[0])
            for index, layer in stream:
                assert layers_equal(layer, layers[index])
    assert 60.0 in holds  # held after layer 0 completed, with the bound of a minute
    assert time.monotonic() - started < 30.0


def test_workers_hold_later_layers_back_while_the_caller_waits_for_layer_0(
    two_threads_held: TenantKV, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once layer 0's last chunk is taken and the caller is blocked on it, a worker with
    nothing left of layer 0 opens no chunk of layer 1 until the caller has layer 0 and comes
    back: a third busy thread would take the core the caller wakes to (docs/perf.md). With the
    bounds raised to a minute, the caller, not a bound, ends the hold."""
    paused: list[bool] = []

    class Recording(FirstLayerHold):
        def pause_s(
            self, *, layer: int, held_until: float | None, now: float, waiting_tasks: int
        ) -> float:
            pause = FirstLayerHold.pause_s(
                self, layer=layer, held_until=held_until, now=now, waiting_tasks=waiting_tasks
            )
            paused.append(pause > 0)
            return pause

    _hold_workers(two_threads_held, Recording(tail_s=60.0, handover_s=60.0))
    opened: list[tuple[int, float]] = []
    open_chunk = chunk_io.ChunkOpener.open
    blocks = 8  # _two_prefixes stores 8 blocks

    def slow_layer_0(
        opener: chunk_io.ChunkOpener, layer: int, work: chunk_io.Work, *args: Any, **kw: Any
    ) -> Any:
        opened.append((layer, time.monotonic()))
        if layer == 0:
            # Layer 0's last chunk (of 4, on 2 workers) finishes long after the others, so the
            # other worker is done with layer 0 while the caller still waits for it.
            last = work.chunk.position + work.chunk.count == blocks
            time.sleep(0.4 if last else 0.05)
        return open_chunk(opener, layer, work, *args, **kw)

    monkeypatch.setattr(chunk_io.ChunkOpener, "open", slow_layer_0)
    ((ns, tokens, layers), _) = _two_prefixes(two_threads_held)
    started = time.monotonic()
    with ns.load(tokens) as stream:
        assert layers_equal(stream.wait_for_layer(0), layers[0])
        handed = time.monotonic()
        for index, layer in stream:
            assert layers_equal(layer, layers[index])
    assert any(paused)  # a worker found itself held before a chunk of layer 1
    per_layer = Counter(layer for layer, _ in opened)
    assert per_layer[0] == 4  # layer 0 cut in twice as many chunks as workers
    later = [at for layer, at in opened if layer > 0]
    assert per_layer == {0: 4, **{layer: per_layer[1] for layer in range(1, len(layers))}}
    assert len(later) == (len(layers) - 1) * per_layer[1]  # every later layer's chunks
    assert min(later) > handed
    assert time.monotonic() - started < 30.0


def test_fresh_layers_cover_exactly_their_rows_after_a_longer_load(kv: TenantKV) -> None:
    kv.create_tenant("big")
    kv.create_tenant("small")
    big = kv.namespace("big", model="m", layout=MLA)
    small = kv.namespace("small", model="m", layout=MLA)
    long_tokens, short_tokens = random_tokens(10 * 64, seed=1), random_tokens(64, seed=2)
    big.store(long_tokens, [torch.full((640, 64), 9.0, dtype=MLA.dtype)] * MLA.num_layers)
    small.store(short_tokens, [torch.full((64, 64), 1.0, dtype=MLA.dtype)] * MLA.num_layers)
    load_all(big, long_tokens)
    for layer in load_all(small, short_tokens):
        assert isinstance(layer, torch.Tensor)
        assert layer.shape[0] == 64 and bool((layer == 1.0).all())


def test_prefetch_reports_the_cached_prefix_and_loads_follow(kv: TenantKV) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(5 * 64 + 10)
    layers = random_layers(MLA, len(tokens))
    assert ns.prefetch(tokens) == 0  # nothing cached yet
    ns.store(tokens, layers)
    assert ns.prefetch(tokens) == 5 * 64
    assert ns.prefetch(tokens[:130]) == 128
    other = kv.namespace("acme", model="m", layout=MLA, scope="other")
    assert other.prefetch(tokens) == 0  # isolation: another scope gets nothing
    for got, want in zip(load_all(ns, tokens[: 5 * 64]), layers, strict=True):
        assert layers_equal(got, prefix_of(want, 5 * 64))


@pytest.mark.usefixtures("index")
def test_closing_the_cache_closes_open_streams(tmp_path: Path) -> None:
    kv = tenantkv.open(tmp_path / "cache", durable=False)
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(128)
    ns.store(tokens, random_layers(MLA, 128))
    stream = ns.load(tokens)
    kv.close()
    assert stream.closed
    with pytest.raises(tenantkv.CacheClosedError):
        stream.wait_for_layer(0)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("layout", [MLA, MHA], ids=["mla", "mha"])
def test_cuda_load_orders_layers_with_events(kv: TenantKV, layout: KVLayout) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=layout)
    tokens = random_tokens(6 * 64)
    layers = random_layers(layout, len(tokens))
    ns.store(tokens, layers)
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer), ns.load(tokens, device="cuda") as stream:
        for index in range(layout.num_layers):
            layer = stream.wait_for_layer(index)  # the consumer stream now waits on the event
            got = (
                layer.cpu() if isinstance(layer, torch.Tensor) else (layer[0].cpu(), layer[1].cpu())
            )
            assert layers_equal(got, layers[index])
    assert kv.staging_stats()["pinned"].in_use == 0


@pytest.mark.cuda
@cuda
def test_cuda_out_buffers_keep_their_pointers(kv: TenantKV) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(4 * 64)
    layers = random_layers(MLA, len(tokens))
    ns.store(tokens, layers)
    out = [
        torch.zeros(8 * 64, MLA.values_per_token, dtype=MLA.dtype, device="cuda") for _ in layers
    ]
    pointers = [buffer.data_ptr() for buffer in out]
    with ns.load(tokens, device="cuda", out=out, block_rows=[256, 0, 64, 448]) as stream:
        for index, layer in stream:
            assert layer is out[index]
    torch.cuda.synchronize()
    for index, buffer in enumerate(out):
        assert buffer.data_ptr() == pointers[index]
        want = layers[index]
        assert isinstance(want, torch.Tensor)
        for block, row in enumerate([256, 0, 64, 448]):
            assert torch.equal(buffer[row : row + 64].cpu(), want[block * 64 : block * 64 + 64])
