"""Worker threads pinned one per CPU (``tenantkv.datapath.cpu_pinning``).

Checked: each thread a pool starts is pinned to the next CPU of the process's affinity mask,
round robin; a cache's loader and sealing threads are so pinned after a store and a load (and
are not with ``pin_workers=False``: the control); a CPU the process may not use leaves the thread
unpinned and is logged once, never raised (a pool initializer that raises breaks the pool).
Speed is not checked here: docs/perf.md has the measurements.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import tenantkv
from tenantkv.datapath.cpu_pinning import CpuPinning, allowed_cpus, pinning_for_pool
from tests.helpers import MLA_SMALL, random_layers, random_tokens

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="the platform has no thread affinity"
)


def _affinity_of_new_thread(pinning: CpuPinning) -> set[int]:
    """The affinity mask of a new thread after ``pinning`` pinned it."""
    seen: list[set[int]] = []

    def run() -> None:
        pinning.pin_current_thread()
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def test_threads_are_pinned_round_robin_over_the_allowed_cpus() -> None:
    cpus = allowed_cpus()
    assert cpus == sorted(os.sched_getaffinity(0))
    pinning = CpuPinning()
    got = [_affinity_of_new_thread(pinning) for _ in range(len(cpus) + 1)]
    want = [{cpus[i % len(cpus)]} for i in range(len(cpus) + 1)]
    assert got == want and pinning.pinned == len(cpus) + 1 and pinning.failed == 0
    # The thread that pinned others keeps its own mask.
    assert os.sched_getaffinity(0) == set(cpus)


def test_a_cpu_that_cannot_be_used_leaves_the_thread_unpinned_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    full = set(allowed_cpus())
    pinning = CpuPinning([max(full) + 4096])  # no such CPU: the kernel refuses the mask
    with caplog.at_level(logging.WARNING, logger="tenantkv"):
        assert _affinity_of_new_thread(pinning) == full
        assert _affinity_of_new_thread(pinning) == full
    assert pinning.failed == 2 and pinning.pinned == 0
    warnings = [r for r in caplog.records if "runs unpinned" in r.getMessage()]
    assert len(warnings) == 1


def _affinities(pool: ThreadPoolExecutor, pinning: CpuPinning | None = None) -> list[set[int]]:
    """The affinity of every thread ``pool`` started; with ``pinning``, once each of them ran
    the initializer (a thread the pool just started may not have yet)."""
    deadline = time.monotonic() + 5
    while pinning is not None and pinning.pinned + pinning.failed < len(pool._threads):
        assert time.monotonic() < deadline, "a started thread never ran the pool's initializer"
        time.sleep(0.01)
    threads = list(pool._threads)  # ThreadPoolExecutor's started threads
    assert threads, "the pool started no thread"
    return [os.sched_getaffinity(t.native_id) for t in threads if t.native_id is not None]


def _store_and_load(kv: tenantkv.TenantKV) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    tokens = random_tokens(256, seed=3)
    layers = random_layers(MLA_SMALL, 256, seed=3)
    ns.store(tokens, layers)
    with ns.load(tokens) as stream:
        got = [layer for _, layer in stream]
    assert all(torch.equal(a, b) for a, b in zip(got, layers, strict=True))  # type: ignore[arg-type]


@pytest.mark.usefixtures("index")
def test_a_caches_worker_threads_are_pinned_one_per_cpu(tmp_path: Path) -> None:
    cpus = allowed_cpus()
    with tenantkv.open(tmp_path / "pinned") as kv:
        _store_and_load(kv)
        runtime = kv.context.runtime
        pools = [
            (runtime.load_executor, runtime.load_pinning),
            (runtime.seal_executor, runtime.seal_pinning),
        ]
        for pool, pinning in pools:
            assert pinning is not None
            affinities = _affinities(pool, pinning)
            assert pinning.pinned == len(affinities) and pinning.failed == 0
            assert all(len(mask) == 1 and mask <= set(cpus) for mask in affinities)
            # A pool's threads share a CPU only once every CPU has one of them.
            assert len({min(mask) for mask in affinities}) == min(len(affinities), len(cpus))
    # Control: unpinned threads keep the process's whole mask.
    with tenantkv.open(tmp_path / "unpinned", pin_workers=False) as kv:
        _store_and_load(kv)
        runtime = kv.context.runtime
        assert runtime.load_pinning is None and runtime.seal_pinning is None
        for pool in (runtime.load_executor, runtime.seal_executor):
            assert all(mask == set(cpus) for mask in _affinities(pool))


@pytest.mark.usefixtures("index")
def test_a_pool_with_more_threads_than_cpus_is_left_unpinned(tmp_path: Path) -> None:
    # Which thread takes a task is arbitrary: two workers of one load could share a CPU.
    cpus = allowed_cpus()
    assert pinning_for_pool(len(cpus)) is not None  # control: as many threads as CPUs
    assert pinning_for_pool(len(cpus) + 1) is None
    with tenantkv.open(tmp_path, load_workers=len(cpus) + 1, seal_workers=1) as kv:
        _store_and_load(kv)
        runtime = kv.context.runtime
        assert runtime.load_pinning is None
        assert all(mask == set(cpus) for mask in _affinities(runtime.load_executor))
        assert runtime.seal_pinning is not None  # one sealing thread: pinned
        assert all(
            len(mask) == 1 for mask in _affinities(runtime.seal_executor, runtime.seal_pinning)
        )


def test_pin_workers_takes_only_a_boolean() -> None:
    with pytest.raises(tenantkv.InvalidRequestError, match="pin_workers"):
        tenantkv.CacheConfig(pin_workers="yes")  # type: ignore[arg-type]
    from_env = tenantkv.CacheConfig.from_env({"TENANTKV_PIN_WORKERS": "0"})
    assert from_env.pin_workers is False
    assert tenantkv.CacheConfig().pin_workers is True
