"""The recycling pool behind fresh layer tensors: a buffer still referenced is never handed out
again (another load would write into a layer a caller holds), a released one is reused."""

from __future__ import annotations

import gc

import torch

from tenantkv.buffers import RecyclingPool


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


def test_sizes_beyond_twice_the_request_or_over_the_budget_are_not_pooled() -> None:
    pool = RecyclingPool(max_bytes=9_000)
    big = pool.buffer(8192)
    del big
    gc.collect()
    small = pool.buffer(1000)  # the idle 8 KiB buffer is more than twice too large: not reused
    assert len(small) == 1000
    assert pool.pooled_bytes == 1000  # the idle 8 KiB buffer was dropped to fit the budget
    over = pool.buffer(20_000)  # beyond the budget: a plain allocation
    assert len(over) == 20_000 and pool.pooled_bytes == 1000
