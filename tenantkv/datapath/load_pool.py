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
from typing import Any, ParamSpec, TypeVar

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
        ticket = _Ticket(self)
        try:
            future = super().submit(self._started, ticket, fn, *args, **kwargs)
        except BaseException:
            # Refused (shut down), or queued but no thread could be started for it: counted
            # out now, once, whether or not the queued task runs later.
            ticket.settle()
            raise
        future.add_done_callback(ticket.settle_if_cancelled)
        return future

    @staticmethod
    def _started(ticket: _Ticket, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        ticket.settle()
        return fn(*args, **kwargs)

    def _count(self, change: int) -> None:
        with self._count_lock:
            self._waiting += change


class _Ticket:
    """One submitted task's place in the pool's count of waiting tasks: counted in when
    submitted, out exactly once, by whichever comes first of its start, its cancellation, or a
    submit that raised."""

    __slots__ = ("_pool", "_settled")

    def __init__(self, pool: LoadPool) -> None:
        self._pool = pool
        self._settled = False
        pool._count(+1)

    def settle(self) -> None:
        with self._pool._count_lock:
            if self._settled:
                return
            self._settled = True
            self._pool._waiting -= 1

    def settle_if_cancelled(self, future: Future[Any]) -> None:
        if future.cancelled():  # never started: shutdown(cancel_futures=True), or cancel()
            self.settle()
