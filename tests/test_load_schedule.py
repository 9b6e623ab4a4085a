"""A load's schedule (``datapath/schedule.py``) alone, the opt-in hold's decisions
(``datapath/worker_hold.py``), the loader pool's count of waiting tasks, and the number of
workers a load runs."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import tenantkv
from tenantkv import KVLayout, Layer, Namespace, TenantKV
from tenantkv.datapath import chunk_io
from tenantkv.datapath.load_pool import LoadPool
from tenantkv.datapath.load_targets import LoadTarget
from tenantkv.datapath.schedule import Schedule
from tenantkv.datapath.worker_hold import FirstLayerHold
from tests.helpers import layers_equal, load_all, random_layers, random_tokens
from tests.indexes import Index


def _schedule(
    num_layers: int = 4, first: int = 4, per: int = 2, window: int = 2, workers: int = 2
) -> Schedule:
    return Schedule(
        num_layers=num_layers, first_chunks=first, chunks=per, window=window, workers=workers
    )


def _take_all(schedule: Schedule) -> list[tuple[int, int]]:
    """Take until the schedule hands out nothing more now."""
    taken = []
    while (chunk := schedule.take()) is not None:
        taken.append(chunk)
    return taken


def _finish(schedule: Schedule, taken: list[tuple[int, int]]) -> list[int]:
    """Finish ``taken`` chunks; return the layers that completed, in the order they did."""
    return [layer for layer, _ in taken if schedule.chunk_done(layer)]


# ---- plain unit tests ------------------------------------------------------------------------


def test_chunks_go_in_layer_order_and_layer_0_has_its_own_cut() -> None:
    schedule = _schedule(num_layers=3, first=4, per=2, window=3)
    assert _take_all(schedule) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert schedule.total == 8 and schedule.busy == 8


def test_takes_stay_within_the_window_of_what_the_caller_consumed() -> None:
    schedule = _schedule(num_layers=5, first=2, per=2, window=2)
    taken = _take_all(schedule)
    assert {layer for layer, _ in taken} == {0, 1}  # window 2: layers 0 and 1
    assert _finish(schedule, taken) == [0, 1]
    assert schedule.take() is None  # complete is not consumed: the window stays
    schedule.consume(0)
    assert _take_all(schedule) == [(2, 0), (2, 1)]
    schedule.consume(1)
    schedule.consume(2)
    assert {layer for layer, _ in _take_all(schedule)} == {3, 4}


def test_waiting_for_a_layer_beyond_the_window_loads_up_to_it() -> None:
    schedule = _schedule(num_layers=6, first=2, per=1, window=1)
    assert schedule.demand(4)
    assert not schedule.demand(2)  # earlier than asked before: nothing new
    taken = _take_all(schedule)
    assert [layer for layer, _ in taken] == [0, 0, 1, 2, 3, 4]
    assert _finish(schedule, taken) == [0, 1, 2, 3, 4]
    assert schedule.take() is None  # layer 5: beyond both the window and the demand


def test_a_caller_that_only_asks_for_layers_moves_the_window_as_one_that_consumes() -> None:
    """Layer hooks (vLLM's ``wait_for_layer_load``) ask for layer ``i`` and never consume: the
    window follows the layer asked for, so tasks read ahead of the caller while it computes."""
    schedule = _schedule(num_layers=6, first=2, per=1, window=2)
    taken = _take_all(schedule)
    assert [layer for layer, _ in taken] == [0, 0, 1]  # the window before the caller asks
    assert _finish(schedule, taken) == [0, 1]
    assert schedule.demand(1)  # asking for layer 1 lets layer 2 be read ahead of it
    assert [layer for layer, _ in _take_all(schedule)] == [2]
    assert schedule.demand(3)
    assert [layer for layer, _ in _take_all(schedule)] == [3, 4]
    assert schedule.take() is None  # layer 5: beyond the window of the layer asked for
    # Control: consuming moves it the same way, never past the window ahead of the caller.
    consumer = _schedule(num_layers=6, first=2, per=1, window=2)
    _finish(consumer, _take_all(consumer))
    consumer.consume(0)
    consumer.consume(1)
    assert [layer for layer, _ in _take_all(consumer)] == [2, 3]
    assert consumer.take() is None


def test_a_layer_completes_only_with_its_last_chunk_whatever_the_order() -> None:
    schedule = _schedule(num_layers=2, first=3, per=2, window=2)
    taken = _take_all(schedule)
    assert _finish(schedule, [taken[2], taken[4], taken[0]]) == []
    assert not schedule.complete(0)
    assert _finish(schedule, [taken[1]]) == [0]
    assert _finish(schedule, [taken[3]]) == [1]
    assert schedule.complete(1) and schedule.busy == 0


def test_tasks_start_up_to_workers_and_again_once_they_left() -> None:
    schedule = _schedule(num_layers=4, first=2, per=2, window=1, workers=3)
    assert schedule.tasks_to_start() == 3
    for _ in range(3):
        schedule.task_started()
    assert schedule.tasks_to_start() == 0  # all running
    taken = _take_all(schedule)
    _finish(schedule, taken)
    for _ in range(3):  # each finds nothing to take (the window is full) and leaves
        assert schedule.take() is None
        assert not schedule.task_left()
    assert schedule.tasks_to_start() == 0  # nothing to take: none started
    schedule.consume(0)
    assert schedule.tasks_to_start() == 3  # the caller made chunks takeable: start again
    schedule.task_started()
    assert schedule.tasks_to_start() == 2  # up to workers, counting those still running


def test_a_task_yields_only_to_waiting_tasks_and_only_with_more_to_take() -> None:
    schedule = _schedule(num_layers=1, first=2, per=1, window=1)
    assert not schedule.must_yield(0)
    assert schedule.must_yield(1)
    _take_all(schedule)
    assert not schedule.must_yield(1)  # nothing left to take: it leaves instead


def test_after_a_failure_only_what_the_caller_asked_for_is_taken() -> None:
    schedule = _schedule(num_layers=5, first=1, per=1, window=4)
    schedule.demand(1)
    (layer, _) = schedule.take() or (-1, -1)
    assert layer == 0
    assert schedule.chunk_dropped(failed=True)  # the first failure is handled
    assert not schedule.fail()  # ... once
    assert [layer for layer, _ in _take_all(schedule)] == [1]  # demanded; 2 and 3 are not
    assert not schedule.nothing_more_comes()  # layer 1's chunk is still running
    schedule.chunk_done(1)
    assert not schedule.nothing_more_comes()  # the failure is not handled yet
    schedule.failure_handled = True
    assert schedule.nothing_more_comes()
    assert not schedule.complete(0)


def test_a_cancelled_chunk_is_no_failure() -> None:
    schedule = _schedule()
    schedule.take()
    assert not schedule.chunk_dropped(failed=False)
    assert not schedule.broken and schedule.busy == 0


def test_a_stopped_schedule_hands_out_nothing_and_tells_leaving_tasks() -> None:
    schedule = _schedule()
    schedule.task_started()
    schedule.stop()
    assert schedule.take() is None and schedule.tasks_to_start() == 0
    assert schedule.task_left()  # a waiter (close) is told


def test_a_load_with_no_chunks_is_complete_at_once() -> None:
    schedule = _schedule(num_layers=3, first=0, per=0)
    assert schedule.total == 0 and schedule.tasks_to_start() == 0
    assert all(schedule.complete(layer) for layer in range(3))


# ---- the schedule against a model ------------------------------------------------------------


class ScheduleMachine(RuleBasedStateMachine):
    """Worker tasks, a caller, failures and a close in any interleaving, against a model: every
    chunk is taken once, in layer order, never beyond the window (unless demanded), a layer
    completes exactly when its last chunk is done, no more than ``workers`` tasks run, a
    takeable chunk always has a task to take it, and a load left to run delivers every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.schedule = _schedule()
        self.tasks: list[tuple[int, int] | None] = []  # per running task: its chunk, if any
        self.taken: list[tuple[int, int]] = []
        self.done: Counter[int] = Counter()
        self.failed = False
        self.demanded = -1  # the model's own record of the caller
        self.released = 0

    @initialize(
        num_layers=st.integers(1, 5),
        shape=st.one_of(
            st.just((0, 0)),  # nothing to read
            st.tuples(st.integers(1, 4), st.integers(1, 3)).map(lambda s: (s[0] * s[1], s[0])),
        ),
        window=st.integers(1, 3),
        workers=st.integers(1, 3),
    )
    def setup(self, num_layers: int, shape: tuple[int, int], window: int, workers: int) -> None:
        first, per = shape
        self.schedule = _schedule(num_layers, first, per, window, workers)
        self.chunks = [first] + [per] * (num_layers - 1)
        self.order = [(layer, i) for layer in range(num_layers) for i in range(self.chunks[layer])]
        self._start()

    def _start(self) -> None:
        for _ in range(self.schedule.tasks_to_start()):
            self.schedule.task_started()
            self.tasks.append(None)

    def _take(self, task: int) -> None:
        schedule = self.schedule
        limit = self.demanded
        if not self.failed:  # the window counts from the later of the two
            limit = max(limit, max(self.released, self.demanded) + schedule.window - 1)
        chunk = schedule.take()
        if chunk is None:
            # A task leaves when it may take nothing now.
            assert (
                schedule.stopped
                or len(self.taken) == len(self.order)
                or (self.order[len(self.taken)][0] > limit)
            )
            schedule.task_left()
            del self.tasks[task]
            return
        assert not schedule.stopped
        assert chunk == self.order[len(self.taken)]  # the next chunk, in layer order
        assert chunk[0] <= limit
        self.taken.append(chunk)
        self.tasks[task] = chunk

    @precondition(lambda self: self.tasks)
    @rule(data=st.data(), outcome=st.sampled_from(["ok", "ok", "ok", "failed", "cancelled"]))
    def task_step(self, data: st.DataObject, outcome: str) -> None:
        """A task takes its next chunk, or finishes the one it has (then takes the next)."""
        task = data.draw(st.integers(0, len(self.tasks) - 1))
        chunk = self.tasks[task]
        if chunk is None:
            self._take(task)
            return
        layer = chunk[0]
        if outcome == "cancelled" and not self.schedule.stopped:
            outcome = "ok"  # chunks are cancelled only once the load is closed
        if outcome == "ok":
            self.done[layer] += 1
            assert self.schedule.chunk_done(layer) == (self.done[layer] == self.chunks[layer])
        else:
            first = self.schedule.chunk_dropped(failed=outcome == "failed")
            assert first == (outcome == "failed" and not self.failed)
            self.failed = self.failed or outcome == "failed"
        self.tasks[task] = None

    @precondition(lambda self: self.released < self.schedule.num_layers)
    @rule(data=st.data())
    def caller_waits_for(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(self.released, self.schedule.num_layers - 1))
        self.demanded = max(self.demanded, index)
        if self.schedule.demand(index):
            self._start()

    @precondition(
        lambda self: (
            self.released < self.schedule.num_layers
            and self.done[self.released] == self.chunks[self.released]
        )
    )
    @rule()
    def caller_consumes(self) -> None:
        self.schedule.consume(self.released)
        self.released += 1
        self._start()

    @precondition(lambda self: self.failed)
    @rule()
    def failure_handled(self) -> None:
        self.schedule.failure_handled = True

    @rule()
    def close(self) -> None:
        self.schedule.stop()

    @invariant()
    def counts_match(self) -> None:
        schedule = self.schedule
        assert schedule.running == len(self.tasks) <= schedule.workers
        assert schedule.busy == sum(chunk is not None for chunk in self.tasks)
        assert len(set(self.taken)) == len(self.taken)
        for layer, count in enumerate(self.chunks):
            assert schedule.remaining[layer] == count - self.done[layer]
            assert schedule.complete(layer) == (self.done[layer] == count)
        assert schedule.broken == self.failed

    @invariant()
    def a_takeable_chunk_has_a_task(self) -> None:
        schedule = self.schedule
        assert schedule.next_layer() < 0 or schedule.running > 0

    @invariant()
    def nothing_more_comes_only_when_nothing_runs(self) -> None:
        schedule = self.schedule
        if schedule.nothing_more_comes():
            assert self.failed and schedule.busy == 0 and schedule.take() is None

    def teardown(self) -> None:
        """Left to run (no failure, no close), with a caller consuming in order, every layer
        completes and every chunk was taken exactly once."""
        schedule = self.schedule
        if schedule.stopped or self.failed or not hasattr(self, "order"):
            return
        for _ in range(10 * (len(self.order) + 10)):
            while (
                self.released < schedule.num_layers
                and self.done[self.released] == self.chunks[self.released]
            ):
                schedule.consume(self.released)
                self.released += 1
                self._start()
            if not self.tasks:
                break
            chunk = self.tasks[0]
            if chunk is None:
                self._take(0)
            else:
                self.done[chunk[0]] += 1
                schedule.chunk_done(chunk[0])
                self.tasks[0] = None
        assert self.released == schedule.num_layers
        assert self.taken == self.order and schedule.running == 0


TestScheduleMachine = ScheduleMachine.TestCase
TestScheduleMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---- the opt-in hold's decisions -------------------------------------------------------------


def test_the_hold_begins_when_layer_0_is_all_taken_and_the_caller_blocks_on_it() -> None:
    hold = FirstLayerHold(tail_s=2.0, handover_s=0.5)
    # after a take: only layer 0's last chunk, with the caller blocked on layer 0
    assert hold.after_take(layer=0, index=3, first_chunks=4, waiting_for=0, now=10.0) == 12.0
    assert hold.after_take(layer=0, index=2, first_chunks=4, waiting_for=0, now=10.0) is None
    assert hold.after_take(layer=0, index=3, first_chunks=4, waiting_for=-1, now=10.0) is None
    assert hold.after_take(layer=1, index=0, first_chunks=4, waiting_for=0, now=10.0) is None
    # before the caller waits: layer 0, once every chunk of it is taken
    assert hold.before_wait(index=0, first_layer_taken=True, now=10.0) == 12.0
    assert hold.before_wait(index=0, first_layer_taken=False, now=10.0) is None
    assert hold.before_wait(index=1, first_layer_taken=True, now=10.0) is None
    # layer 0 complete for a blocked caller: the hand-over bound
    assert hold.after_complete(layer=0, waiting_for=0, now=10.0) == 10.5
    assert hold.after_complete(layer=0, waiting_for=-1, now=10.0) is None
    assert hold.after_complete(layer=1, waiting_for=1, now=10.0) is None
    # the caller back for a later layer ends it
    assert hold.ends(1) and hold.ends(5) and not hold.ends(0)


@pytest.mark.parametrize(
    ("layer", "held_until", "waiting_tasks", "pause"),
    [
        (1, 10.5, 0, 0.5),  # held: wait out the rest of the bound (or until the caller is back)
        (3, 10.2, 0, 0.2),
        (0, 10.5, 0, 0.0),  # layer 0 itself never waits
        (1, None, 0, 0.0),  # not held
        (1, 9.0, 0, 0.0),  # the bound passed
        (1, 10.5, 1, 0.0),  # another task waits for this worker's thread
    ],
)
def test_a_worker_pauses_only_for_a_later_layer_while_held(
    layer: int, held_until: float | None, waiting_tasks: int, pause: float
) -> None:
    got = FirstLayerHold().pause_s(
        layer=layer, held_until=held_until, now=10.0, waiting_tasks=waiting_tasks
    )
    assert got == pytest.approx(pause)


# ---- the loader pool ---------------------------------------------------------------------------


def test_the_load_pool_counts_tasks_that_wait_for_a_thread() -> None:
    pool = LoadPool(1, "test-load")
    release = threading.Event()
    running = threading.Event()
    try:
        assert pool.waiting() == 0

        def block() -> None:
            running.set()
            release.wait(5.0)

        first = pool.submit(block)
        assert running.wait(5.0)
        assert pool.waiting() == 0  # started
        queued = [pool.submit(lambda x: x, i) for i in range(2)]
        assert pool.waiting() == 2
        assert queued[0].cancel()
        assert pool.waiting() == 1  # a cancelled task waits no more
        release.set()
        first.result(5.0)
        assert queued[1].result(5.0) == 1
        assert pool.waiting() == 0
    finally:
        release.set()
        pool.shutdown(wait=True)


def test_the_hold_is_off_unless_the_config_turns_it_on(tmp_path: Path, index: Index) -> None:
    for on in (False, True):
        kv = tenantkv.open(tmp_path / str(on), durable=False, hold_workers_for_first_layer=on)
        try:
            hold = kv.context.runtime.load_executor.first_layer_hold
            assert (hold == FirstLayerHold()) if on else hold is None
        finally:
            kv.close()
    with pytest.raises(tenantkv.InvalidRequestError, match="hold_workers_for_first_layer"):
        tenantkv.open(tmp_path / "bad", hold_workers_for_first_layer="yes")


# ---- workers of a load -------------------------------------------------------------------------

MLA = KVLayout.mla(3, kv_lora_rank=48, rope_dim=16, dtype=torch.bfloat16)


@pytest.fixture
def three_loader_threads(tmp_path: Path, index: Index) -> Iterator[TenantKV]:
    """One sealing thread, three loader threads; staged reads, so only workers open chunks."""
    cache = tenantkv.open(
        tmp_path / "cache", durable=False, seal_workers=1, load_workers=3, map_reads=False
    )
    try:
        yield cache
    finally:
        cache.close()


def test_the_count_stays_right_when_no_thread_can_be_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ThreadPoolExecutor.submit`` queues the task before it starts a thread; where the start
    fails, the submit raises, and the queued task may still run later on a thread started for
    another: counted out once, not twice."""
    pool = LoadPool(2, "test-load")
    release = threading.Event()
    ran: list[int] = []
    try:
        busy = pool.submit(release.wait, 5.0)  # the one thread so far, kept busy
        assert pool.waiting() == 0  # control: a task that starts is counted out
        real_start = threading.Thread.start

        def cannot_start(self: threading.Thread) -> None:
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(threading.Thread, "start", cannot_start)
        with pytest.raises(RuntimeError, match="start new thread"):
            pool.submit(ran.append, 2)  # queued, but the second thread never started
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert pool.waiting() == 0
        release.set()
        assert busy.result(5.0)
        pool.shutdown(wait=True)  # the queued task runs on the first thread
        assert ran == [2]
        assert pool.waiting() == 0  # counted out once, not again when it ran
    finally:
        release.set()
        pool.shutdown(wait=False)


def _stored(kv: TenantKV, blocks: int, seed: int) -> tuple[Namespace, list[int], list[Layer]]:
    """acme's namespace holding a prefix of ``blocks`` blocks: the namespace, tokens, layers."""
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(blocks * 64, seed=seed)
    want = random_layers(MLA, len(tokens), seed=seed + 1)
    ns.store(tokens, want)
    return ns, tokens, want


@pytest.mark.parametrize("hold", [False, True], ids=["default", "hold"])
def test_a_load_runs_as_many_workers_as_the_load_pool_has_threads(
    three_loader_threads: TenantKV, hold: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 0 is cut in twice as many chunks as the load runs workers, later layers in as
    many: with 3 loader threads (and 1 sealing thread), 6 and 3; the bytes are the stored ones,
    with the hold opted in too."""
    kv = three_loader_threads
    if hold:
        kv.context.runtime.load_executor.first_layer_hold = FirstLayerHold(segments=1)
    opened: Counter[int] = Counter()
    open_chunk = chunk_io.ChunkOpener.open

    def counting(opener: Any, layer: int, *args: Any, **kw: Any) -> Any:
        opened[layer] += 1
        return open_chunk(opener, layer, *args, **kw)

    monkeypatch.setattr(chunk_io.ChunkOpener, "open", counting)
    ns, tokens, want = _stored(kv, 12, seed=41)
    got = load_all(ns, tokens)
    assert all(layers_equal(a, b) for a, b in zip(got, want, strict=True))
    assert opened == {0: 6, 1: 3, 2: 3}


def _within(seconds: float, call: Any) -> BaseException | None:
    """Run ``call`` on a thread; the exception it raised (None if none). Fails if it is still
    running after ``seconds``: a hang, not an answer."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: the load hangs"
    return outcome[0]


def test_a_layer_that_cannot_be_allocated_breaks_the_load_instead_of_hanging_it(
    three_loader_threads: TenantKV, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, tokens, want = _stored(three_loader_threads, 12, seed=51)
    got = load_all(ns, tokens)  # control: the same load, whole
    assert len(got) == len(want) and all(map(layers_equal, got, want))
    allocate = LoadTarget.new_layer

    def out_of_memory(target: LoadTarget, layer: int) -> Any:
        if layer == 2:
            raise MemoryError("no memory for layer 2")
        return allocate(target, layer)

    monkeypatch.setattr(LoadTarget, "new_layer", out_of_memory)
    error = _within(20.0, lambda: load_all(ns, tokens))
    assert error is not None and "layer 2" in repr(error) + repr(error.__cause__)


def test_a_load_that_starts_while_the_cache_closes_is_refused_not_left_open(
    three_loader_threads: TenantKV, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, tokens, want = _stored(three_loader_threads, 4, seed=53)
    got = load_all(ns, tokens)  # control: while the cache is open, the load goes through
    assert len(got) == len(want) and all(map(layers_equal, got, want))
    runtime = three_loader_threads.context.runtime
    # The cache's close takes the list of open streams between a load's check that the cache
    # is open and the load's stream being tracked.
    monkeypatch.setattr(runtime, "check_open", lambda: None)
    runtime.begin_close()
    error = _within(20.0, lambda: ns.load(tokens))
    assert isinstance(error, tenantkv.CacheClosedError)
    # The close above was only begun: the fixture's close() would find the runtime closed and
    # return, leaving the cache's background threads (PostgreSQL: the lease and key-epoch
    # writer, which outlived the test's schema) and its index open. Finish it here.
    runtime._closed = False
    three_loader_threads.close()
    assert not three_loader_threads._coordination._thread.is_alive()
