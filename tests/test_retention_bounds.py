"""Bounds on a tenant's retention classes (issue 13, item 8): a tenant may not grow its map past
``MAX_RETENTION_CLASSES`` by merging updates, and a load's bookkeeping costs the same number of
index statements whatever number of classes its tenant has."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from tenantkv import InvalidRequestError, TenantKV
from tenantkv.retention import MAX_RETENTION_CLASSES
from tests.helpers import MLA_SMALL, ManualClock, held_background
from tests.test_tenants import (
    MODEL,
    extents_of,
    loads_exact,
    new_tenant,
    open_cache,
    prefix,
    store_one,
    tenant_id,
)

DEFAULT_CLASSES = 2  # agent and chat, which every tenant has


def extra_classes(count: int, start: int = 0) -> dict[str, str]:
    return {f"c{i:02d}": f"{i + 1}h" for i in range(start, start + count)}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000_000.0)


@pytest.fixture
def cache(cache_root: Path, clock: ManualClock) -> Iterator[TenantKV]:
    kv = open_cache(cache_root, clock, secrets.token_bytes(32))
    try:
        yield kv
    finally:
        kv.close()


def test_merging_updates_cannot_grow_retention_past_the_cap(cache: TenantKV) -> None:
    allowed = MAX_RETENTION_CLASSES - DEFAULT_CLASSES
    new_tenant(cache, "a")
    # positive control: classes up to the cap are accepted, over several updates
    cache.update_tenant("a", retention=extra_classes(allowed // 2))
    cache.update_tenant("a", retention=extra_classes(allowed - allowed // 2, allowed // 2))
    full = cache.get_tenant("a").retention
    assert full is not None and len(full) == MAX_RETENTION_CLASSES
    # changing an existing class is still fine at the cap
    cache.update_tenant("a", retention={"c00": "2h"})
    assert cache.get_tenant("a").retention == {**full, "c00": 7200.0}
    before = cache.get_tenant("a")
    with pytest.raises(InvalidRequestError, match="classes"):
        cache.update_tenant("a", retention={"one-more": "1h", "c01": "5h"})
    assert cache.get_tenant("a") == before  # nothing changed, not even c01
    with pytest.raises(InvalidRequestError, match="classes"):
        cache.create_tenant("b", quota_bytes=2**20, retention=extra_classes(allowed + 1))
    assert [t.name for t in cache.list_tenants()] == ["a"]


def _bookkeeping_statements(kv: TenantKV, tenant: str, kind: str, seed: int) -> list[str]:
    """Store one extent of ``kind`` in ``tenant``, load it, then run that load's bookkeeping
    and return the SQL statements it issued."""
    ns = kv.namespace(tenant, model=MODEL, layout=MLA_SMALL)
    p = prefix(seed)
    store_one(kv, ns, p, kind=kind)
    tasks = held_background(kv)
    assert loads_exact(ns, p)
    assert tasks, "a load hands its record of use to the background"
    statements: list[str] = []
    me = threading.get_ident()

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if threading.get_ident() == me:
            statements.append(statement)

    engine = kv.context.index.engine
    event.listen(engine, "before_cursor_execute", count)
    try:
        for task in tasks:
            task()
    finally:
        event.remove(engine, "before_cursor_execute", count)
    return statements


def test_a_loads_bookkeeping_does_not_grow_with_the_tenants_classes(
    cache: TenantKV, clock: ManualClock
) -> None:
    new_tenant(cache, "few")  # the two default classes
    new_tenant(cache, "many", retention=extra_classes(MAX_RETENTION_CLASSES - DEFAULT_CLASSES))
    assert len(cache.get_tenant("many").retention or {}) == MAX_RETENTION_CLASSES
    stored_at = clock.now
    clock.now += 100.0
    few = _bookkeeping_statements(cache, "few", "chat", seed=1)
    many = _bookkeeping_statements(cache, "many", "c07", seed=2)
    assert len(few) == len(many), (few, many)
    assert sum(s.lstrip().upper().startswith("UPDATE") for s in many) == 1
    # positive control: the loads' use was recorded, each extent's expiry by its own class
    for tenant, ttl in (("few", 7 * 86400.0), ("many", 8 * 3600.0)):
        (row,) = extents_of(cache, tenant_id(cache, tenant)).values()
        assert row.last_used_at == clock.now != stored_at
        assert row.expires_at == clock.now + ttl
