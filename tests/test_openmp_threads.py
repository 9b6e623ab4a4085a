"""The cache's own threads run torch's kernels on themselves alone: none of them starts an
OpenMP team beside the model's (tenantkv/openmp_threads.py says why). The vLLM connector's
threads: tests_engines/test_vllm_threads.py."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import tenantkv
from tenantkv import openmp_threads
from tests.helpers import store_and_load_checked

#: Where the count of the process's threads can be read, and torch may start a team at all.
TEAMS_OBSERVABLE = sys.platform == "linux" and torch.get_num_threads() > 1
needs_teams = pytest.mark.skipif(
    not TEAMS_OBSERVABLE, reason="needs Linux and torch with more than one OpenMP thread"
)


def _process_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _in_new_thread(work: Callable[[], Any]) -> Any:
    """``work()``'s result, run on a thread started for it (and joined)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    thread.join()
    return result[0]


def _copy_counting_threads(one_thread: bool) -> tuple[int, int]:
    """On the calling thread: (its torch thread count, threads the process gained while it
    filled and copied 4M floats, kernels torch runs in parallel)."""
    if one_thread:
        assert openmp_threads.use_one_openmp_thread()
    before = _process_threads()
    source = torch.ones(1 << 22)
    torch.empty_like(source).copy_(source)
    return torch.get_num_threads(), _process_threads() - before


@needs_teams
def test_a_thread_on_one_openmp_thread_starts_no_team_of_its_own() -> None:
    main_threads = torch.get_num_threads()
    # Three threads each way: another test's thread starting or ending during one copy moves
    # the process's count by one, never in all three.
    one = [_in_new_thread(lambda: _copy_counting_threads(one_thread=True)) for _ in range(3)]
    assert all(count == 1 for count, _ in one)
    assert min(gained for _, gained in one) <= 0
    # Control: the same copy on a thread left at torch's default starts an OpenMP team.
    left = [_in_new_thread(lambda: _copy_counting_threads(one_thread=False)) for _ in range(3)]
    assert all(count == main_threads for count, _ in left)
    assert max(gained for _, gained in left) >= 1
    assert torch.get_num_threads() == main_threads  # the caller's own count is untouched


def _counts_per_thread(pool: ThreadPoolExecutor, threads: int) -> list[int]:
    """``torch.get_num_threads()`` on each of ``threads`` distinct threads of ``pool``: each
    task waits for the others, so no two run on one thread."""
    barrier = threading.Barrier(threads, timeout=10)

    def count() -> int:
        barrier.wait()
        return torch.get_num_threads()

    return [f.result(timeout=10) for f in [pool.submit(count) for _ in range(threads)]]


def _cache_pool_counts(root: Path) -> list[int]:
    with tenantkv.open(root, durable=False) as kv:
        store_and_load_checked(kv, seed=5)
        runtime = kv.context.runtime
        return [
            *_counts_per_thread(runtime.load_executor, runtime.load_threads),
            *_counts_per_thread(runtime.seal_executor, runtime.workers),
            *_counts_per_thread(runtime.bookkeeping_executor, 1),
        ]


@needs_teams
@pytest.mark.usefixtures("index")
def test_the_caches_pools_run_torch_on_one_thread_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    main_threads = torch.get_num_threads()
    counts = _cache_pool_counts(tmp_path / "one")
    assert counts and all(count == 1 for count in counts)
    assert torch.get_num_threads() == main_threads  # the caller's (the model's) count stays
    # Control: with the setting off, the pools' threads keep torch's default count.
    monkeypatch.setattr(openmp_threads, "ONE_THREAD_ON_CACHE_THREADS", False)
    assert all(count == main_threads for count in _cache_pool_counts(tmp_path / "default"))
