"""The vLLM connector's save and asynchronous-load threads run torch's kernels on themselves
alone, as the cache's pools do (tests/test_openmp_threads.py; tenantkv/openmp_threads.py)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from tenantkv.integrations.paged_kv import RequestBlocks
from tenantkv.integrations.vllm.metadata import SaveSpec
from tenantkv.integrations.vllm.saves import BackgroundSaves, SaveJob
from tenantkv.integrations.vllm.worker_side import WorkerSide
from tests.helpers import MLA_SMALL


class _Engine:
    """What the vLLM connector's background threads need of the engine here: nothing but the
    failure counter (no namespace is ever asked for)."""

    layout = MLA_SMALL
    block_tokens = 16

    def __init__(self) -> None:
        self.failures: list[str] = []

    def failed(self, what: str, err: BaseException, **_: Any) -> None:
        self.failures.append(f"{what}: {err}")


@pytest.mark.skipif(
    sys.platform != "linux" or torch.get_num_threads() < 2,
    reason="needs Linux and torch with more than one OpenMP thread",
)
def test_the_vllm_connectors_save_and_load_threads_run_torch_on_one_thread() -> None:
    engine: Any = _Engine()
    seen: list[int] = []
    saves = BackgroundSaves(engine, store=lambda job: seen.append(torch.get_num_threads()))
    try:
        owner: Any = None  # never read: the store above asks for no namespace
        spec = SaveSpec("r1", owner, (1, 2), (0,), 0)
        saves.submit(SaveJob(spec, [], RequestBlocks([0]), 1))
        saves.drain()
    finally:
        saves.shutdown()
    assert seen == [1] and saves.completed == 1 and not engine.failures
    worker = WorkerSide(engine, ["layer.0"])
    try:
        assert worker._async_pool.submit(torch.get_num_threads).result(timeout=10) == 1
    finally:
        worker.shutdown()
    # Control: a thread pool of torch's default, beside them, keeps the process's count.
    with ThreadPoolExecutor(1) as default:
        assert default.submit(torch.get_num_threads).result(timeout=10) > 1
