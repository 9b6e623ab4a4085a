"""The loader pool: a thread pool that knows how many of its tasks wait for a thread.

Every load runs its worker tasks here (``loader.py``); a task that has more to do but sees
others waiting queues itself behind them, so concurrent loads share the threads chunk by chunk.
The count is the pool's own (tasks submitted and neither started nor cancelled), not a look at
the executor's private queue.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from .worker_hold import FirstLayerHold

P = ParamSpec("P")
T = TypeVar("T")


class LoadPool(ThreadPoolExecutor):
    """``threads`` threads named ``name`` (each set up by ``initializer``) that count their
    waiting tasks; ``first_layer_hold`` is the policy its loads' workers follow for callers
    blocked on layer 0 (``worker_hold.py``; ``None``: none, the default)."""

    def __init__(
        self,
        threads: int,
        name: str,
        initializer: Callable[[], object] | None = None,
        *,
        first_layer_hold: FirstLayerHold | None = None,
    ) -> None:
        super().__init__(threads, thread_name_prefix=name, initializer=initializer)
        self.threads = threads
        self.first_layer_hold = first_layer_hold
        self._count_lock = threading.Lock()
        self._waiting = 0

    def waiting(self) -> int:
        """Tasks submitted that have neither started nor been cancelled (a racy read: it may
        be a task behind)."""
        return self._waiting

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        with self._count_lock:
            self._waiting += 1
        try:
            future = super().submit(self._started, fn, *args, **kwargs)
        except BaseException:
            self._count(-1)
            raise
        future.add_done_callback(self._forget_if_cancelled)
        return future

    def _started(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        self._count(-1)
        return fn(*args, **kwargs)

    def _forget_if_cancelled(self, future: Future[T]) -> None:
        if future.cancelled():  # never started: shutdown(cancel_futures=True), or cancel()
            self._count(-1)

    def _count(self, change: int) -> None:
        with self._count_lock:
            self._waiting += change
