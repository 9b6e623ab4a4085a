"""The schedule of a load: which chunk is taken next, by how many tasks, and when a layer is done.

A plain state machine: no threads, locks or clocks. The stream's workers (``load_workers.py``)
call it under the stream's one lock and do what it says; ``tests/test_load_schedule.py`` drives
it alone.

A load runs up to ``workers`` tasks on the cache's loader pool that pull chunks from the load's
own sequence (layer 0, then 1, ...), so while one task opens a chunk of layer ``l``, another is
already reading layer ``l+1``, and the caller consumes earlier layers. A task takes its next
chunk in the same critical section that counts its last one done: per chunk there is one lock
round trip and no pool task, future or callback: per-chunk pool tasks cost Python time, and the
interpreter is what limits loads on small machines, where decryption barely scales to a second
thread (handing chunks from reader threads to separate decrypt workers was measured slower too;
docs/perf.md).

Layer 0 is cut in twice as many chunks (the caller waits on it first; a task that is ahead takes
over part of a delayed one's share), and a task that finds no chunk of it left takes one of
layer 1 (a task leaving and another starting was measured later to the first layer).

Layers stay within ``window`` layers of where the caller is: the layer it asked for last
(``wait_for_layer``) or the first it has not consumed (iteration), whichever is later;
``wait_for_layer(i)`` always loads up to ``i``. An engine's layer hooks ask and never consume:
counted from consumption alone, the window left the tasks ``window`` layers into the prefix, and
each later layer was read only once the caller was blocked on it (docs/perf.md, "Layer hooks: a
read-ahead window that follows the caller"). A task leaves when it may take nothing more, and
whoever makes a chunk takeable again (the caller consuming a layer or asking for a later one)
starts tasks up to ``workers`` again.
When other tasks (another load's, the cache's bookkeeping) wait for the pool's threads, a task
queues itself behind them after its chunk, so concurrent loads share the pool chunk by chunk.

After a failure only what the caller already asked for is taken; after a stop (close, or the
pool shut down) nothing is.
"""

from __future__ import annotations


class Schedule:
    """Chunks of ``num_layers`` layers: ``first_chunks`` in layer 0, ``chunks`` in each other.

    Chunks are numbered in layer order; :meth:`take` hands them out once each, as
    ``(layer, index in the layer)``.
    """

    def __init__(
        self, *, num_layers: int, first_chunks: int, chunks: int, window: int, workers: int
    ) -> None:
        self.num_layers = num_layers
        self.first_chunks = first_chunks
        self.chunks = chunks
        self.total = first_chunks + (num_layers - 1) * chunks if chunks else 0
        self.window = max(1, window)
        self.workers = max(1, workers)
        #: Per layer: chunks not yet done (a layer is complete at 0).
        self.remaining = [first_chunks] + [chunks] * (num_layers - 1)
        self.next_item = 0  # the next chunk to hand out, in layer order
        self.demanded = -1  # the caller asked for this layer: load up to it whatever the window
        self.released = 0  # layers before this were consumed (handed over and let go)
        self.waiting_for = -1  # the layer the caller is blocked on, if any
        self.running = 0  # tasks started (queued or running) and not yet left
        self.busy = 0  # chunks taken and not yet finished
        self.broken = False  # a chunk failed: take nothing beyond what was demanded
        self.failure_handled = False  # the failure was dealt with (evicted and recorded)
        self.stopped = False  # closed, or the pool shut down: take nothing more

    # ---- taking chunks ---------------------------------------------------------------------

    def next_layer(self) -> int:
        """The layer of the next chunk to take, or -1 while none may be taken."""
        item = self.next_item
        if item >= self.total or self.stopped:
            return -1
        first = self.first_chunks
        layer = 0 if item < first else 1 + (item - first) // self.chunks
        if layer > self.demanded:
            if self.broken:
                return -1  # after a failure, only what the caller already asked for
            if layer >= max(self.released, self.demanded) + self.window:
                return -1  # far enough ahead of the caller
        return layer

    def take(self) -> tuple[int, int] | None:
        """Hand out the next chunk, ``(layer, index in the layer)``; ``None`` if none may be
        taken now."""
        layer = self.next_layer()
        if layer < 0:
            return None
        item = self.next_item
        self.next_item = item + 1
        self.busy += 1
        if layer == 0:
            return 0, item
        return layer, (item - self.first_chunks) % self.chunks

    @property
    def first_layer_taken(self) -> bool:
        """Every chunk of layer 0 was handed out."""
        return self.next_item >= self.first_chunks

    def helpable(self, index: int) -> bool:
        """Whether the caller, waiting for layer ``index``, may take its next chunk."""
        return not self.broken and self.next_layer() == index

    # ---- tasks ----------------------------------------------------------------------------

    def tasks_to_start(self) -> int:
        """How many more tasks to start now (each reported by :meth:`task_started`)."""
        if self.running >= self.workers or self.next_layer() < 0:
            return 0
        return self.workers - self.running

    def task_started(self) -> None:
        assert self.running < self.workers, "no more than workers tasks run"
        self.running += 1

    def task_left(self) -> bool:
        """A task ended (it found nothing to take, or never started). Returns whether a waiter
        is to be told: once the load is stopped or broken, waiters wait for tasks to leave."""
        assert self.running > 0, "a task left that never started"
        self.running -= 1
        return self.stopped or self.broken

    def must_yield(self, waiting_tasks: int) -> bool:
        """Whether a task, between chunks, leaves its thread to ``waiting_tasks`` other tasks
        of the pool and queues itself behind them (it has more to take)."""
        return waiting_tasks > 0 and self.next_layer() >= 0

    # ---- chunks done ------------------------------------------------------------------------

    def chunk_done(self, layer: int) -> bool:
        """A taken chunk of ``layer`` opened; returns whether the layer is now complete."""
        assert self.busy > 0 and self.remaining[layer] > 0, "only a taken chunk is done"
        self.busy -= 1
        remaining = self.remaining[layer] - 1
        self.remaining[layer] = remaining
        return remaining == 0

    def chunk_dropped(self, *, failed: bool) -> bool:
        """A taken chunk did not open: cancelled, or ``failed``. Returns whether this is the
        load's first failure (it is to be handled, once)."""
        assert self.busy > 0, "only a taken chunk is dropped"
        self.busy -= 1
        return failed and self.fail()

    def fail(self) -> bool:
        """The load broke; returns whether it is the first time."""
        first, self.broken = not self.broken, True
        return first

    def complete(self, layer: int) -> bool:
        return self.remaining[layer] == 0

    def nothing_more_comes(self) -> bool:
        """Broken, its failure dealt with, and every chunk taken has finished: a layer not
        complete now never will be."""
        return self.broken and self.failure_handled and self.busy == 0 and self.next_layer() < 0

    # ---- the caller ---------------------------------------------------------------------------

    def demand(self, index: int) -> bool:
        """The caller asks for layer ``index``; returns whether that makes more takeable (then
        start tasks)."""
        if index <= self.demanded:
            return False
        self.demanded = index
        return True

    def consume(self, index: int) -> None:
        """The caller has layer ``index`` and let go of it (iteration): the window moves on
        (then start tasks)."""
        self.released = max(self.released, index + 1)

    def stop(self) -> None:
        self.stopped = True
