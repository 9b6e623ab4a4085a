"""Records of use are written in batches (tenantkv.components.use_records).

Loads that close while a batch waits for its turn join it: one write transaction per tenant
for all of them, each extent written once at its latest use. Records still pending when the
cache closes are written by the close. Every check that a write was batched or deferred has its
positive control: the records do land, with the loads' times.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

import tenantkv
import tenantkv.components.use_records
import tenantkv.datapath.runtime
from tenantkv import TenantKV
from tests.helpers import (
    MLA_SMALL,
    ManualClock,
    held_background,
    last_used,
    load_all,
    random_layers,
    random_tokens,
)
from tests.test_tenants import extents_of, open_cache, tenant_id, wait_for

TOKENS = 64  # one block: one extent per prefix


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000_000.0)


@pytest.fixture
def master_key() -> bytes:
    return secrets.token_bytes(32)


@pytest.fixture
def cache(cache_root: Path, clock: ManualClock, master_key: bytes) -> Iterator[TenantKV]:
    kv = open_cache(cache_root, clock, master_key)
    try:
        yield kv
    finally:
        kv.close()


def _prefixes(
    kv: TenantKV, tenant: str, seeds: tuple[int, ...]
) -> tuple[tenantkv.Namespace, dict[int, list[int]], dict[int, str]]:
    """A tenant holding a one-block prefix per seed; their tokens and extent ids by seed."""
    kv.create_tenant(tenant, quota_bytes=2**24)
    ns = kv.namespace(tenant, model="m", layout=MLA_SMALL)
    tokens, ids = {}, {}
    for seed in seeds:
        before = set(last_used(kv))
        tokens[seed] = random_tokens(TOKENS, seed=seed)
        assert ns.store(tokens[seed], random_layers(MLA_SMALL, TOKENS, seed=seed)) == TOKENS
        (ids[seed],) = set(last_used(kv)) - before
    return ns, tokens, ids


def _write_transactions(kv: TenantKV, run: Callable[[], None]) -> int:
    """How many write transactions committed while ``run`` ran."""
    commits = 0

    def count(_connection: object) -> None:
        nonlocal commits
        commits += 1

    engine = kv.context.index.engine
    event.listen(engine, "commit", count)
    try:
        run()
    finally:
        event.remove(engine, "commit", count)
    return commits


def test_loads_closed_while_a_batch_waits_are_written_in_a_transaction_per_tenant(
    cache: TenantKV, clock: ManualClock
) -> None:
    a, a_tokens, a_ids = _prefixes(cache, "a", (1, 2))
    b, b_tokens, b_ids = _prefixes(cache, "b", (3,))
    stored = last_used(cache)
    tasks = held_background(cache)
    times = {}
    for seed, ns, tokens in (
        (1, a, a_tokens),
        (2, a, a_tokens),
        (3, b, b_tokens),
        (1, a, a_tokens),
    ):
        times[seed] = clock.advance(10.0)
        load_all(ns, tokens[seed])
    assert len(tasks) == 1, "only the batch's first record hands a write to the background"
    assert last_used(cache) == stored, "nothing written before the batch runs"
    assert cache.context.uses.pending == 3
    assert _write_transactions(cache, tasks[0]) == 2  # tenants a and b: 4 loads
    # Control: every load's use landed, each extent at its latest load (seed 1 twice).
    used = last_used(cache)
    for seed, extent_id in {**a_ids, **b_ids}.items():
        assert used[extent_id] == times[seed] > stored[extent_id]
    assert cache.context.uses.pending == 0
    assert (cache.context.uses.recorded, cache.context.uses.written) == (4, 4)
    # The next load starts a new batch.
    load_all(a, a_tokens[2])
    assert len(tasks) == 2


def test_loads_an_engine_step_apart_share_one_batch(cache: TenantKV, clock: ManualClock) -> None:
    """An engine loads once per step (tens of milliseconds apart): a batch waits long enough
    (``BOOKKEEPING_DELAY_S``) to take several such loads, so their records cost one write, not
    a write each beside the engine's next steps."""
    ns, tokens, ids = _prefixes(cache, "a", (1, 2))
    stored = last_used(cache)
    runtime = cache.context.runtime
    handed_over = []
    submit = runtime.submit_background

    def counted(task: Callable[..., object], *args: object) -> None:
        handed_over.append(task)
        submit(task, *args)

    runtime.submit_background = counted  # type: ignore[method-assign]
    times = {}
    started = time.monotonic()
    for step in range(5):  # 30 ms apart, as a forward step of a small model on a CPU
        seed = 1 + step % 2
        times[seed] = clock.advance(10.0)
        load_all(ns, tokens[seed])
        time.sleep(0.03)
    elapsed = time.monotonic() - started
    wait_for(lambda: cache.context.uses.written == 5)
    batches = len(handed_over)
    # A batch takes every load of its delay: at most one batch per delay of loading ...
    assert batches <= 1 + (elapsed + 0.01) / tenantkv.datapath.runtime.BOOKKEEPING_DELAY_S
    # ... so loads 30 ms apart share batches (a 20 ms delay gave each its own), unless this
    # machine took over a second for five small loads.
    assert batches < 5 or elapsed > 1.0, f"{batches} batches for 5 loads in {elapsed:.2f} s"
    # Control: every load's use landed, each extent at its latest load.
    used = last_used(cache)
    for seed, extent_id in ids.items():
        assert used[extent_id] == times[seed] > stored[extent_id]


def test_a_batch_keeps_the_latest_use_whatever_order_loads_close_in(cache: TenantKV) -> None:
    _ns, _tokens, ids = _prefixes(cache, "a", (1,))
    tasks = held_background(cache)
    tenant = tenant_id(cache, "a")
    uses = cache.context.uses
    uses.record(tenant, [ids[1]], 2_000_000.0)
    uses.record(tenant, [ids[1]], 1_500_000.0)  # a load that started earlier closes later
    assert len(tasks) == 1
    tasks[0]()
    assert last_used(cache)[ids[1]] == 2_000_000.0


def test_records_pending_at_close_are_written_by_the_close(
    cache_root: Path, clock: ManualClock, master_key: bytes
) -> None:
    kv = open_cache(cache_root, clock, master_key)
    try:
        ns, tokens, ids = _prefixes(kv, "a", (1,))
        stored = last_used(kv)
        tasks = held_background(kv)  # never run: as if the shutdown cancelled the batch
        used_at = clock.advance(10.0)
        load_all(ns, tokens[1])
        assert tasks and last_used(kv) == stored
    finally:
        kv.close()
    reopened = open_cache(cache_root, clock, master_key)
    try:
        assert last_used(reopened)[ids[1]] == used_at > stored[ids[1]]
    finally:
        reopened.close()


def test_a_failed_batch_is_logged_and_the_next_one_is_written(
    cache: TenantKV,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ns, tokens, ids = _prefixes(cache, "a", (1,))
    stored = last_used(cache)
    tasks = held_background(cache)

    def unreachable(*_args: object) -> dict[str, float]:
        raise OperationalError("UPDATE", {}, Exception("index unreachable"))

    with monkeypatch.context() as patch:
        patch.setattr(tenantkv.components.use_records, "record_use", unreachable)
        clock.advance(10.0)
        load_all(ns, tokens[1])
        with caplog.at_level(logging.WARNING, logger="tenantkv"):
            tasks[0]()  # raises nothing: bookkeeping never fails a load or a close
    assert "could not record extent use" in caplog.text
    assert last_used(cache) == stored and cache.context.uses.pending == 0
    assert (cache.context.uses.written, cache.context.uses.failed) == (0, 1)
    # Control: with the index back, the next load's batch is written.
    used_at = clock.advance(10.0)
    load_all(ns, tokens[1])
    assert len(tasks) == 2
    tasks[1]()
    assert last_used(cache)[ids[1]] == used_at


def test_one_tenants_failed_write_does_not_drop_anothers_records(
    cache: TenantKV, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, a_tokens, a_ids = _prefixes(cache, "a", (1,))
    b, b_tokens, b_ids = _prefixes(cache, "b", (2,))
    stored = last_used(cache)
    tasks = held_background(cache)
    failing = tenant_id(cache, "b")
    record_use = tenantkv.components.use_records.record_use

    def fails_for_b(connection: object, tenant_id: bytes, uses: object) -> dict[str, float]:
        if tenant_id == failing:
            raise OperationalError("SELECT", {}, Exception("row lock timeout"))
        return record_use(connection, tenant_id, uses)  # type: ignore[arg-type]

    monkeypatch.setattr(tenantkv.components.use_records, "record_use", fails_for_b)
    used_at = clock.advance(10.0)
    load_all(a, a_tokens[1])
    load_all(b, b_tokens[2])
    assert len(tasks) == 1
    tasks[0]()
    assert last_used(cache)[b_ids[2]] == stored[b_ids[2]]
    # Control: the other tenant's use, in the same batch, was written.
    assert last_used(cache)[a_ids[1]] == used_at > stored[a_ids[1]]
    assert (cache.context.uses.written, cache.context.uses.failed) == (1, 1)


# One step: record a use (tenant, prefix, seconds after the start), or write the batch (None).
_STEPS = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(("a", "b")), st.integers(1, 2), st.integers(0, 1_000)),
        st.none(),
    ),
    max_size=25,
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(steps=_STEPS)
def test_written_uses_match_a_model_of_latest_use_per_batch(
    cache: TenantKV, steps: list[tuple[str, int, int] | None]
) -> None:
    """Whatever the order of records and writes, a written batch leaves each of its extents at
    its latest use in that batch -- or at a later one written before, which an earlier use never
    moves back (two nodes' batches commit in any order) -- and the other extents as they were."""
    uses = cache.context.uses
    if not cache.list_tenants():  # the cache is shared by the examples: set it up once
        for tenant, seeds in (("a", (1, 2)), ("b", (3, 4))):
            _prefixes(cache, tenant, seeds)
    tenants = {name: tenant_id(cache, name) for name in ("a", "b")}
    extents = {name: sorted(extents_of(cache, tid)) for name, tid in tenants.items()}
    tasks = held_background(cache)
    uses.flush()  # a previous example's leftovers
    model = last_used(cache)
    batch: dict[str, float] = {}
    for step in [*steps, None]:
        if step is None:
            for task in tasks:
                task()
            tasks.clear()
            model.update({key: max(model[key], used) for key, used in batch.items()})
            batch = {}
            assert last_used(cache) == model
            continue
        tenant, which, offset = step
        extent_id = extents[tenant][which - 1]
        used_at = 2_000_000.0 + offset
        uses.record(tenants[tenant], [extent_id], used_at)
        batch[extent_id] = max(batch.get(extent_id, used_at), used_at)
    assert uses.pending == 0
