"""The recycling pool behind fresh layer tensors: a buffer still referenced is never handed out
again (another load would write into a layer a caller holds), a released one is reused."""

from __future__ import annotations

import gc

import torch

from tenantkv.datapath.buffers import RECENT_LOADS_S, RecyclingPool
from tests.helpers import ManualClock


def _address(view: memoryview) -> int:
    return torch.frombuffer(view, dtype=torch.uint8).data_ptr()


def test_a_released_buffer_is_reused() -> None:
    pool = RecyclingPool(max_bytes=1 << 20)
    first = pool.buffer(4096)
    address = _address(first)
    del first
    gc.collect()
    assert _address(pool.buffer(4096)) == address  # positive control for the tests below
    assert pool.pooled_bytes == 4096


def test_a_buffer_held_through_a_tensor_or_a_slice_is_not_handed_out_again() -> None:
    pool = RecyclingPool(max_bytes=1 << 20)
    held_tensor = torch.frombuffer(pool.buffer(4096), dtype=torch.bfloat16).view(32, 64)
    held_slice = pool.buffer(4096)[100:200]
    held = {held_tensor.data_ptr(), _address(held_slice) - 100}
    for _ in range(3):
        again = pool.buffer(4096)
        assert _address(again) not in held
        del again
    assert pool.pooled_bytes == 3 * 4096  # one more buffer, reused by every later call


def test_sizes_beyond_twice_the_request_are_not_reused_and_trim_keeps_the_budget() -> None:
    pool = RecyclingPool(max_bytes=9_000)
    big = pool.buffer(8192)
    big_address = _address(big)
    del big
    gc.collect()
    small = pool.buffer(1000)  # the idle 8 KiB buffer is more than twice too large: not reused
    assert len(small) == 1000 and _address(small) != big_address
    assert pool.idle_bytes == 8192
    over = pool.buffer(20_000)  # beyond the budget, held by its caller: tracked all the same
    assert len(over) == 20_000 and pool.pooled_bytes == 8192 + 1000 + 20_000
    pool.trim()  # 8 KiB idle is within the budget: kept
    assert pool.pooled_bytes == 29_192 and pool.idle_bytes == 8192
    del over
    gc.collect()
    pool.trim()  # 28,192 B idle: released oldest first until what stays idle fits 9,000 B
    assert pool.idle_bytes == 0 and pool.pooled_bytes == 1000
    assert len(small) == 1000  # the held buffer stays


def test_layers_kept_beyond_the_budget_are_reused_by_the_next_load() -> None:
    # A caller that keeps whole prefixes (a model's cache) and drops them between requests
    # gets the same memory back, instead of faulting in fresh pages for every layer.
    pool = RecyclingPool(max_bytes=4096)
    kept = [pool.buffer(4096) for _ in range(8)]
    addresses = {_address(view) for view in kept}
    assert len(addresses) == 8
    pool.trim()  # all held: nothing to release
    del kept
    gc.collect()
    again = [pool.buffer(4096) for _ in range(8)]
    assert {_address(view) for view in again} == addresses
    del again
    gc.collect()
    pool.trim()
    assert pool.idle_bytes == 4096 and pool.pooled_bytes == 4096


def test_the_smallest_idle_buffer_that_fits_is_reused() -> None:
    pool = RecyclingPool(max_bytes=1 << 20)
    larger, exact = pool.buffer(7000), pool.buffer(4096)
    addresses = _address(larger), _address(exact)
    del larger, exact
    gc.collect()
    first = pool.buffer(4000)
    assert _address(first) == addresses[1]  # both fit; the smaller one is taken
    assert _address(pool.buffer(4000)) == addresses[0]  # while the smaller one is held


def test_trim_keeps_what_the_caller_asks_for_beyond_the_budget() -> None:
    pool = RecyclingPool(max_bytes=4096)
    held = [pool.buffer(4096) for _ in range(4)]
    del held
    gc.collect()
    pool.trim(keep=3 * 4096)  # a load with three long layers in flight keeps them for the next
    assert pool.idle_bytes == 3 * 4096
    pool.trim()
    assert pool.idle_bytes == 4096


def _load(pool: RecyclingPool, layer_bytes: int, in_flight: int) -> set[int]:
    """One load's fresh layers, all dropped by its caller, then its trim; their addresses."""
    layers = [pool.buffer(layer_bytes) for _ in range(in_flight)]
    addresses = {_address(layer) for layer in layers}
    del layers
    gc.collect()
    pool.trim(keep=in_flight * layer_bytes, layer_bytes=layer_bytes)
    return addresses


def test_a_short_load_between_long_ones_keeps_the_long_layers_until_they_are_not_recent() -> None:
    clock = ManualClock()
    pool = RecyclingPool(max_bytes=4096, clock=clock)
    long_layers = _load(pool, 64 * 1024, 4)
    assert pool.idle_bytes == 4 * 64 * 1024  # positive control: the load's own layers stay
    short_layers = _load(pool, 4096, 4)
    # The short load's trim kept the long layers: the next long load reuses every one of them.
    assert pool.idle_bytes == 4 * 64 * 1024 + 4 * 4096
    clock.now += 1.0
    assert _load(pool, 64 * 1024, 4) == long_layers
    assert _load(pool, 4096, 4) == short_layers
    # Once no long load ended for RECENT_LOADS_S, a short load's trim lets the long layers go.
    clock.now += RECENT_LOADS_S + 1.0
    _load(pool, 4096, 4)
    assert pool.idle_bytes == 4 * 4096


def test_the_working_set_of_many_recent_lengths_is_at_most_twice_the_largest() -> None:
    clock = ManualClock()
    pool = RecyclingPool(max_bytes=0, clock=clock)
    largest = 4 * 12 * 1024
    # Twelve lengths, shortest first (a longer load cannot reuse a shorter one's layers), each
    # load keeping four layers of its own: 312 KiB in all, were the working set not bounded.
    for kib in range(1, 13):
        _load(pool, kib * 1024, 4)
    assert pool.idle_bytes <= 2 * largest
    assert pool.idle_bytes >= largest  # the most recent lengths' layers are kept
