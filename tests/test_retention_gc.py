"""Retention classes, garbage collection (expired extents, orphans, leftovers, CLI, background)
and metering, on a real cache with a fake clock."""

from __future__ import annotations

import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

import tenantkv
from tenantkv import CacheMissError, InvalidRequestError, TenantKV
from tenantkv.cli import main
from tenantkv.index.schema import Extent
from tests.helpers import MLA_SMALL, ManualClock
from tests.indexes import Index
from tests.test_tenants import (
    BIG_QUOTA,
    CAPACITY,
    MODEL,
    Prefix,
    extent_files,
    extent_path,
    extents_of,
    loads_exact,
    new_tenant,
    open_cache,
    prefix,
    store_one,
    tenant_id,
    wait_for,
    wait_touched,
)

DAY = 86400.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(float(int(time.time()) // 60 * 60))


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


def extent_count(kv: TenantKV) -> int:
    with kv.context.index.read() as session:
        return int(session.scalar(select(func.count()).select_from(Extent)) or 0)


def copy_as_orphan(root: Path, extent_id: str, age: float) -> Path:
    """Copy an extent file to a fresh random id (unindexed) last modified ``age`` seconds ago."""
    new_id = secrets.token_hex(16)
    target = extent_path(root, new_id)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(extent_path(root, extent_id), target)
    then = time.time() - age
    os.utime(target, (then, then))
    return target


# ---- retention ------------------------------------------------------------------------------


def test_agent_prefix_expires_three_days_after_its_store(
    cache: TenantKV, clock: ManualClock
) -> None:
    ns = new_tenant(cache, "a")
    assert cache.get_tenant("a").retention == {"agent": 3 * DAY, "chat": 7 * DAY}
    p = prefix(1)
    start = clock.now
    store_one(cache, ns, p, kind="agent")
    clock.now = start + 3 * DAY - 1
    assert ns.lookup(p.tokens) == 64
    clock.now = start + 3 * DAY + 1
    assert ns.lookup(p.tokens) == 0
    with pytest.raises(CacheMissError):
        ns.load(p.tokens)
    usage = cache.usage("a").counters
    assert usage["hit_tokens"] == 64 and usage["miss_tokens"] == 64
    cache.gc()
    assert ns.store(p.tokens, p.layers, kind="agent") == 64  # once collected, stored anew
    assert loads_exact(ns, p)


def test_an_expired_prefix_can_be_stored_again_before_gc(
    cache: TenantKV, clock: ManualClock
) -> None:
    ns = new_tenant(cache, "a")
    p = prefix(19)
    store_one(cache, ns, p, kind="agent")
    clock.advance(3 * DAY + 1)
    assert ns.lookup(p.tokens) == 0  # expired
    assert ns.store(p.tokens, p.layers, kind="agent") == 64
    assert ns.lookup(p.tokens) == 64
    assert loads_exact(ns, p)


def test_chat_prefix_lasts_seven_days(cache: TenantKV, clock: ManualClock) -> None:
    ns = new_tenant(cache, "a")
    chat, agent = prefix(2), prefix(3)
    start = clock.now
    store_one(cache, ns, chat)  # chat is the default class
    store_one(cache, ns, agent, kind="agent")
    clock.now = start + 3 * DAY + 1
    assert ns.lookup(chat.tokens) == 64 and ns.lookup(agent.tokens) == 0
    clock.now = start + 7 * DAY - 1
    assert ns.lookup(chat.tokens) == 64
    clock.now = start + 7 * DAY + 1
    assert ns.lookup(chat.tokens) == 0


def test_a_load_refreshes_expiry(cache: TenantKV, clock: ManualClock) -> None:
    ns = new_tenant(cache, "a")
    loaded, untouched = prefix(4), prefix(5)
    start = clock.now
    loaded_id = store_one(cache, ns, loaded, kind="agent")
    store_one(cache, ns, untouched, kind="agent")
    clock.now = start + 2 * DAY
    assert loads_exact(ns, loaded)
    wait_touched(cache, loaded_id, clock.now)
    clock.now = start + 3 * DAY + 1
    assert ns.lookup(loaded.tokens) == 64
    assert ns.lookup(untouched.tokens) == 0  # control: the same class without a load expired
    clock.now = start + 5 * DAY + 1
    assert ns.lookup(loaded.tokens) == 0


def test_retention_is_per_tenant(cache: TenantKV, clock: ManualClock) -> None:
    short = new_tenant(cache, "short", retention={"agent": "1h", "chat": "2h"})
    default = new_tenant(cache, "default")
    p = prefix(6)
    start = clock.now
    for ns in (short, default):
        store_one(cache, ns, p, kind="agent")
    clock.now = start + 3599
    assert short.lookup(p.tokens) == 64  # positive control
    clock.now = start + 3601
    assert short.lookup(p.tokens) == 0
    assert default.lookup(p.tokens) == 64
    assert cache.get_tenant("short").retention == {"agent": 3600.0, "chat": 7200.0}


def test_update_retention_changes_expiry_of_existing_extents(
    cache: TenantKV, clock: ManualClock
) -> None:
    ns = new_tenant(cache, "a")
    agent, chat = prefix(7), prefix(8)
    start = clock.now
    agent_id = store_one(cache, ns, agent, kind="agent")
    chat_id = store_one(cache, ns, chat, kind="chat")
    clock.advance(10)
    cache.update_tenant("a", retention={"agent": "1h", "chat": "30d"})
    extents = extents_of(cache, tenant_id(cache, "a"))
    assert extents[agent_id].expires_at == start + 3600  # counted from the last use
    assert extents[chat_id].expires_at == start + 30 * DAY
    clock.now = start + 3601
    assert ns.lookup(agent.tokens) == 0
    assert ns.lookup(chat.tokens) == 64
    clock.now = start + 7 * DAY + 1  # past the old chat retention
    assert ns.lookup(chat.tokens) == 64
    clock.now = start + 30 * DAY + 1
    assert ns.lookup(chat.tokens) == 0
    # new stores use the new retention too
    fresh = prefix(9)
    fresh_id = store_one(cache, ns, fresh, kind="agent")
    assert extents_of(cache, tenant_id(cache, "a"))[fresh_id].expires_at == clock.now + 3600


# ---- gc -------------------------------------------------------------------------------------


def test_gc_removes_expired_extents_index_and_bytes(
    cache: TenantKV, cache_root: Path, clock: ManualClock
) -> None:
    ns = new_tenant(cache, "a")
    gone, kept = prefix(10), prefix(11, blocks=2)
    gone_id = store_one(cache, ns, gone, kind="agent")
    gone_bytes = cache.get_tenant("a").used_bytes
    kept_id = store_one(cache, ns, kept, kind="chat")
    clock.advance(3 * DAY + 1)
    assert ns.lookup(gone.tokens) == 0  # a miss at once ...
    assert extent_path(cache_root, gone_id).exists()  # ... and still there until GC
    assert gone_id in extents_of(cache, tenant_id(cache, "a"))
    calls: list[tuple[int, int]] = []
    report = cache.gc(progress=lambda done, total: calls.append((done, total)))
    assert (report.expired_extents, report.expired_bytes) == (1, gone_bytes)
    assert (report.orphans_removed, report.temporary_removed) == (0, 0)
    assert not extent_path(cache_root, gone_id).exists()
    assert set(extents_of(cache, tenant_id(cache, "a"))) == {kept_id}
    assert extent_files(cache_root) == {kept_id}
    assert loads_exact(ns, kept)
    assert calls and calls[-1] == (3, 3)  # one expired extent, two files looked at
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    usage = cache.usage("a").counters
    assert usage["expired_extents"] == 1 and usage["expired_bytes"] == gone_bytes
    assert usage["evicted_extents"] == 0
    assert cache.gc() == tenantkv.GcReport(0, 0, 0, 0)


def test_gc_drops_the_index_row_first_even_if_the_bytes_cannot_go(
    cache: TenantKV, cache_root: Path, clock: ManualClock
) -> None:
    ns = new_tenant(cache, "a")
    p = prefix(12)
    extent_id = store_one(cache, ns, p, kind="agent")
    path = extent_path(cache_root, extent_id)
    path.unlink()
    path.mkdir()  # unlink() of a directory fails: the bytes cannot be removed
    clock.advance(3 * DAY + 1)
    report = cache.gc()
    assert report.expired_extents == 1
    assert extent_count(cache) == 0  # the index no longer points at the extent
    assert path.is_dir()  # what could not be removed is left for the orphan sweep
    path.rmdir()
    path.write_bytes(b"left behind")
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    assert cache.gc().orphans_removed == 1
    assert not path.exists()


def test_orphan_sweep_removes_old_unindexed_files_and_spares_young_ones(
    cache: TenantKV, cache_root: Path, clock: ManualClock
) -> None:
    ns = new_tenant(cache, "a")
    p = prefix(13)
    extent_id = store_one(cache, ns, p)
    old = copy_as_orphan(cache_root, extent_id, age=3600)
    young = copy_as_orphan(cache_root, extent_id, age=0)
    report = cache.gc(orphan_grace=600)
    assert report.orphans_removed == 1 and report.expired_extents == 0
    assert not old.exists()
    assert young.exists()  # possibly a store between writing and indexing
    assert extent_path(cache_root, extent_id).exists()  # indexed: kept however old
    assert loads_exact(ns, p)
    clock.advance(700)  # the young one is now past the grace
    assert cache.gc(orphan_grace=600).orphans_removed == 1
    assert not young.exists()
    assert extent_files(cache_root) == {extent_id}
    assert loads_exact(ns, p)


def test_gc_sweeps_old_leftover_temporary_files(cache: TenantKV, cache_root: Path) -> None:
    tmp = cache_root / "blocks" / "tmp"
    old, young = tmp / f"{secrets.token_hex(16)}.part", tmp / f"{secrets.token_hex(16)}.part"
    old.write_bytes(b"crashed writer")
    young.write_bytes(b"running writer")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    report = cache.gc(orphan_grace=600)
    assert report.temporary_removed == 1
    assert not old.exists() and young.exists()


def test_cli_gc_collects_and_prints_a_summary(
    cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = ManualClock(time.time() - 2 * DAY)  # stored two days ago, kept for an hour
    with tenantkv.open(cache_root, durable=False, capacity_bytes=CAPACITY, clock=clock) as kv:
        ns = new_tenant(kv, "a", retention={"agent": "1h"})
        expired_id = store_one(kv, ns, prefix(14), kind="agent")
        kept = prefix(15)
        kept_id = store_one(kv, ns, kept, kind="chat")
        orphan = copy_as_orphan(cache_root, kept_id, age=3600)
    assert main(["gc", str(cache_root)]) == 0
    captured = capsys.readouterr()
    assert "gc: 1 expired extents" in captured.out
    assert "1 orphaned files and 0 leftover temporary files removed" in captured.out
    assert captured.err == ""  # no bar when stderr is no terminal (a job: tests/test_cli_admin.py)
    assert not orphan.exists() and not extent_path(cache_root, expired_id).exists()
    with tenantkv.open(cache_root, durable=False) as kv:
        assert extent_count(kv) == 1
        assert loads_exact(kv.namespace("a", model=MODEL, layout=MLA_SMALL), kept)
    assert main(["gc", str(cache_root / "missing")]) == 1


def _gc_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tenantkv-gc" and t.is_alive()]


def test_background_gc_collects_expired_extents_and_stops_at_close(
    cache_root: Path, clock: ManualClock, master_key: bytes
) -> None:
    before = len(_gc_threads())
    kv = open_cache(cache_root, clock, master_key)
    try:
        with pytest.raises(InvalidRequestError):
            kv.start_background_gc(0)
        with pytest.raises(InvalidRequestError):
            kv.start_background_gc(-1.0)
        ns = new_tenant(kv, "a")
        expired_id = store_one(kv, ns, prefix(16), kind="agent")
        kept_id = store_one(kv, ns, prefix(17), kind="chat")
        kv.start_background_gc(0.02)
        kv.start_background_gc(0.02)  # idempotent
        assert len(_gc_threads()) == before + 1
        time.sleep(0.1)
        assert extent_count(kv) == 2  # nothing is due yet
        clock.advance(3 * DAY + 1)
        wait_for(lambda: not extent_path(cache_root, expired_id).exists())
        assert set(extents_of(kv, tenant_id(kv, "a"))) == {kept_id}
        # metered just after the bytes go: wait for it too
        wait_for(lambda: kv.usage("a").counters["expired_extents"] == 1)
        assert extent_path(cache_root, kept_id).exists()
    finally:
        kv.close()
    assert len(_gc_threads()) == before


def test_gc_interval_option_starts_the_background_gc(
    cache_root: Path, clock: ManualClock, master_key: bytes
) -> None:
    before = len(_gc_threads())
    with open_cache(cache_root, clock, master_key, gc_interval=0.02) as kv:
        assert len(_gc_threads()) == before + 1
        ns = new_tenant(kv, "a")
        expired_id = store_one(kv, ns, prefix(18), kind="agent")
        clock.advance(3 * DAY + 1)
        wait_for(lambda: not extent_path(cache_root, expired_id).exists())
        assert extent_count(kv) == 0
    assert len(_gc_threads()) == before


# ---- metering -------------------------------------------------------------------------------


def test_usage_counts_hits_misses_served_and_stored(cache: TenantKV) -> None:
    ns = new_tenant(cache, "a")
    p = prefix(20, blocks=2)
    store_one(cache, ns, p)
    longer = [*p.tokens, *prefix(21).tokens]  # 128 cached tokens, then 64 new ones
    assert ns.lookup(longer) == 128
    assert ns.lookup(prefix(22).tokens) == 0
    assert ns.lookup(longer[:100]) == 64  # 64 hit, 36 missed
    assert loads_exact(ns, p)
    with ns.load(p.tokens):  # abandoned before any layer: nothing served
        pass
    report = cache.usage("a")
    assert report.counters == {
        "hit_tokens": 128 + 64,
        "miss_tokens": 64 + 64 + 36,
        "served_tokens": 128,
        "served_bytes": 128 * MLA_SMALL.num_layers * MLA_SMALL.token_bytes,  # decoded, all layers
        "stored_tokens": 128,
        "stored_bytes": cache.get_tenant("a").used_bytes,
        "evicted_extents": 0,
        "evicted_bytes": 0,
        "expired_extents": 0,
        "expired_bytes": 0,
    }
    assert report["served_tokens"] == 128
    assert report.hit_cost == pytest.approx(1 / 50)
    assert report.cost_units == pytest.approx(164 + 128 / 50)
    assert report.tenant == "a" and report.scope is None


def test_custom_hit_cost(cache_root: Path, clock: ManualClock, master_key: bytes) -> None:
    with open_cache(cache_root, clock, master_key, hit_cost=0.5) as kv:
        ns = new_tenant(kv, "a")
        p = prefix(23)
        store_one(kv, ns, p)
        assert ns.lookup([*p.tokens, *prefix(24).tokens]) == 64
        assert loads_exact(ns, p)
        report = kv.usage("a")
        assert report.counters["miss_tokens"] == 64 and report.counters["served_tokens"] == 64
        assert report.cost_units == pytest.approx(64 + 0.5 * 64)


def test_usage_per_scope_and_all_scopes(cache: TenantKV) -> None:
    new_tenant(cache, "a")
    spaces = {
        scope: cache.namespace("a", model=MODEL, layout=MLA_SMALL, scope=scope)
        for scope in (None, "s1", "s2")
    }
    p = prefix(25)
    for count, ns in enumerate(spaces.values(), start=1):
        ns.store(p.tokens, p.layers)
        for _ in range(count):  # 1, 2 and 3 hits
            assert ns.lookup(p.tokens) == 64
    assert loads_exact(spaces["s2"], p)
    assert cache.usage("a", scope="s1").counters["hit_tokens"] == 128
    s2 = cache.usage("a", scope="s2").counters
    assert s2["hit_tokens"] == 192 and s2["served_tokens"] == 64
    assert cache.usage("a", scope="s1").counters["served_tokens"] == 0
    assert cache.usage("a", scope="").counters["hit_tokens"] == 64  # the tenant-wide scope
    everything = cache.usage("a")
    assert everything.counters["hit_tokens"] == 64 + 128 + 192
    assert everything.counters["stored_tokens"] == 3 * 64
    assert everything.counters["served_tokens"] == 64
    assert all(v == 0 for v in cache.usage("a", scope="nope").counters.values())


def test_usage_since_until_select_60_second_buckets(cache: TenantKV, clock: ManualClock) -> None:
    ns = new_tenant(cache, "a")
    t0 = clock.now  # a bucket boundary
    for minute, misses in ((0, 1), (1, 2), (3, 4)):
        clock.now = t0 + 60 * minute + 5
        for _ in range(misses):
            ns.lookup(prefix(26).tokens)

    def misses(**window: Any) -> int:
        return cache.usage("a", **window).counters["miss_tokens"] // 64

    assert misses() == 7
    assert misses(since=t0, until=t0 + 60) == 1
    assert misses(since=t0 + 60) == 6
    assert misses(until=t0 + 120) == 3
    assert misses(since=t0 + 120, until=t0 + 180) == 0
    assert misses(since=t0 + 180, until=t0 + 240) == 4
    assert misses(since=t0 + 240) == 0
    assert misses(until=t0) == 0


def test_usage_of_adjacent_windows_adds_up(cache: TenantKV, clock: ManualClock) -> None:
    ns = new_tenant(cache, "a")
    t0 = clock.now
    clock.now = t0 + 10
    ns.lookup(prefix(27).tokens)

    def misses(since: float, until: float) -> int:
        return cache.usage("a", since=since, until=until).counters["miss_tokens"]

    whole = misses(t0, t0 + 120)
    assert whole == 64  # positive control
    assert misses(t0, t0 + 60) + misses(t0 + 60, t0 + 120) == whole
    # Under a bucket a window would read zeros that mean nothing: refused, naming the bucket.
    with pytest.raises(InvalidRequestError, match="metering resolution of 60 seconds"):
        misses(t0, t0 + 30)
    with pytest.raises(InvalidRequestError, match="since must be before until"):
        misses(t0 + 30, t0 + 30)


def test_evictions_are_metered_in_the_scope_of_the_evicted_extent(
    cache: TenantKV, clock: ManualClock, extent_bytes: int
) -> None:
    new_tenant(cache, "a", quota=2 * extent_bytes)
    s1 = cache.namespace("a", model=MODEL, layout=MLA_SMALL, scope="s1")
    s2 = cache.namespace("a", model=MODEL, layout=MLA_SMALL, scope="s2")
    store_one(cache, s1, prefix(28))
    for seed in (29, 30):
        clock.advance(10)
        store_one(cache, s2, prefix(seed))
    assert s1.lookup(prefix(28).tokens) == 0
    assert cache.usage("a", scope="s1").counters["evicted_extents"] == 1
    assert cache.usage("a", scope="s1").counters["evicted_bytes"] == extent_bytes
    assert cache.usage("a", scope="s2").counters["evicted_extents"] == 0
    assert cache.usage("a", scope="s2").counters["stored_tokens"] == 128


@pytest.fixture(scope="module")
def extent_bytes(tmp_path_factory: pytest.TempPathFactory, index: Index) -> int:
    root = tmp_path_factory.mktemp("measure")
    with tenantkv.open(root, durable=False, capacity_bytes=CAPACITY) as kv:
        ns = new_tenant(kv, "probe")
        store_one(kv, ns, prefix(0))
        return kv.get_tenant("probe").used_bytes


def _scenario_for_a(root: Path, master_key: bytes, b_busy: bool) -> dict[str, int]:
    """Tenant a's usage after a fixed sequence of its own calls, with tenant b idle or busy."""
    clock = ManualClock(float(int(time.time()) // 60 * 60))
    with open_cache(root, clock, master_key) as kv:
        a = new_tenant(kv, "a", retention={"agent": "1h"})
        b = new_tenant(kv, "b", retention={"agent": "1h"})
        shared = prefix(31, blocks=2)
        steps: list[Prefix] = [shared, prefix(32)]
        for step, p in enumerate(steps):
            if b_busy:  # the same tokens and more, in b's namespace
                b.store(shared.tokens, shared.layers, kind="agent")
                b.lookup(shared.tokens)
                assert loads_exact(b, shared)
                b.lookup(prefix(40 + step).tokens)
            a.store(p.tokens, p.layers, kind="agent")
            a.lookup([*p.tokens, *prefix(50 + step).tokens])
            assert loads_exact(a, p)
            clock.advance(60)
        clock.advance(3600)
        a.lookup(shared.tokens)  # expired for a
        kv.gc()
        if b_busy:
            assert kv.usage("b").counters["hit_tokens"] > 0  # positive control: b did work
            assert kv.usage("b").counters["expired_extents"] > 0
        return kv.usage("a").counters


@pytest.mark.usefixtures("index")
def test_usage_of_one_tenant_never_includes_anothers(tmp_path: Path, master_key: bytes) -> None:
    idle = _scenario_for_a(tmp_path / "idle", master_key, b_busy=False)
    busy = _scenario_for_a(tmp_path / "busy", master_key, b_busy=True)
    assert idle == busy
    assert idle["hit_tokens"] == 128 + 64 and idle["served_tokens"] == 192
    assert idle["expired_extents"] == 2


def test_usage_survives_reopening(cache_root: Path, clock: ManualClock, master_key: bytes) -> None:
    with open_cache(cache_root, clock, master_key) as kv:
        ns = new_tenant(kv, "a")
        p = prefix(33)
        store_one(kv, ns, p)
        assert ns.lookup(p.tokens) == 64  # not flushed before close
    with open_cache(cache_root, clock, master_key) as kv:
        usage = kv.usage("a").counters
        assert usage["hit_tokens"] == 64 and usage["stored_tokens"] == 64
        assert kv.get_tenant("a").quota_bytes == BIG_QUOTA
