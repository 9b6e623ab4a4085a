"""Tenants: lifecycle, bad input, capacity and overcommit, quota eviction, keys, crypto-shredding.

Every test runs a real cache (SQLite or PostgreSQL index, local extent files, a master key) with
a fake clock. Sizes are measured (one 64-token store of ``MLA_SMALL`` is one extent of
``extent_bytes``), not hard-coded. Retention, GC and metering are in ``test_retention_gc.py``.
"""

from __future__ import annotations

import json
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import func, select

import tenantkv
from tenantkv import (
    CacheMissError,
    InvalidRequestError,
    Layer,
    Namespace,
    QuotaExceededError,
    TenantExistsError,
    TenantKV,
    TenantNotFoundError,
)
from tenantkv.components.keyring import data_key_context
from tenantkv.crypto import (
    CipherSuite,
    ExtentCipher,
    KeyEncryptionKey,
    SealOpenError,
    SegmentContext,
)
from tenantkv.datapath.extent_format import ExtentGeometry
from tenantkv.index.schema import Block, DataKey, Extent, Tenant, Usage
from tenantkv.index.schema import Namespace as NamespaceRow
from tests.helpers import (
    MLA_SMALL,
    ManualClock,
    layers_equal,
    load_all,
    random_layers,
    random_tokens,
)
from tests.indexes import Index

CAPACITY = 2**30
BIG_QUOTA = 2**24
MODEL = "m"


@dataclass(frozen=True)
class Prefix:
    tokens: list[int]
    layers: list[Layer]


def prefix(seed: int, blocks: int = 1) -> Prefix:
    """A random prefix of ``blocks`` full 64-token blocks in MLA_SMALL."""
    n = 64 * blocks
    return Prefix(random_tokens(n, seed=seed), random_layers(MLA_SMALL, n, seed=seed))


@pytest.fixture
def clock() -> ManualClock:
    """Starts at a minute boundary near the real time, so file modification times and the
    cache's idea of "now" agree for the orphan sweep."""
    return ManualClock(float(int(time.time()) // 60 * 60))


@pytest.fixture
def master_key() -> bytes:
    return secrets.token_bytes(32)


def open_cache(root: Path, clock: ManualClock, master_key: bytes, **options: Any) -> TenantKV:
    """Open, then set the capacity and overcommit policy by the explicit operator call."""
    capacity = {
        "capacity_bytes": options.pop("capacity_bytes", CAPACITY),
        "allow_overcommit": options.pop("allow_overcommit", None),
    }
    kv = tenantkv.open(
        root, durable=False, clock=clock, master_key=KeyEncryptionKey(master_key), **options
    )
    try:
        kv.set_capacity(**capacity)
    except BaseException:
        kv.close()
        raise
    return kv


@pytest.fixture
def cache(cache_root: Path, clock: ManualClock, master_key: bytes) -> Iterator[TenantKV]:
    kv = open_cache(cache_root, clock, master_key)
    try:
        yield kv
    finally:
        kv.close()


@pytest.fixture(scope="module")
def extent_bytes(tmp_path_factory: pytest.TempPathFactory, index: Index) -> int:
    """What one 64-token store of MLA_SMALL takes in the store, measured."""
    root = tmp_path_factory.mktemp("measure")
    with tenantkv.open(root, durable=False, capacity_bytes=CAPACITY) as kv:
        kv.create_tenant("probe", quota_bytes=BIG_QUOTA)
        ns = kv.namespace("probe", model=MODEL, layout=MLA_SMALL)
        p = prefix(0)
        assert ns.store(p.tokens, p.layers) == 64
        size = kv.get_tenant("probe").used_bytes
        assert kv.info()["extents"] == 1
    plain = MLA_SMALL.num_layers * 64 * MLA_SMALL.token_bytes
    assert plain < size < 2 * plain  # sealed: plaintext plus tags and a header
    return size


# ---- index and file helpers ---------------------------------------------------------------------


def tenant_id(kv: TenantKV, name: str) -> bytes:
    with kv.context.index.read() as session:
        found = session.scalar(select(Tenant.id).where(Tenant.name == name))
    assert found is not None
    return found


def extents_of(kv: TenantKV, tid: bytes) -> dict[str, Extent]:
    with kv.context.index.read() as session:
        rows = session.scalars(select(Extent).where(Extent.tenant_id == tid)).all()
    return {row.id: row for row in rows}


def data_key_versions(kv: TenantKV, tid: bytes) -> list[int]:
    with kv.context.index.read() as session:
        return sorted(session.scalars(select(DataKey.version).where(DataKey.tenant_id == tid)))


def extent_path(root: Path, extent_id: str) -> Path:
    return root / "blocks" / "extents" / extent_id[:2] / f"{extent_id}.tkx"


def extent_files(root: Path) -> set[str]:
    return {p.stem for p in (root / "blocks" / "extents").glob("*/*.tkx")}


def temp_files(root: Path) -> list[Path]:
    return list((root / "blocks" / "tmp").iterdir())


def store_one(kv: TenantKV, ns: Namespace, p: Prefix, kind: str = "chat") -> str:
    """Store ``p`` as one new extent and return its id."""
    tid = ns.identity.tenant_id
    before = set(extents_of(kv, tid))
    assert ns.store(p.tokens, p.layers, kind=kind) == len(p.tokens)
    new = set(extents_of(kv, tid)) - before
    assert len(new) == 1
    return new.pop()


def loads_exact(ns: Namespace, p: Prefix) -> bool:
    got = load_all(ns, p.tokens)
    return len(got) == len(p.layers) and all(
        layers_equal(a, b) for a, b in zip(got, p.layers, strict=True)
    )


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def wait_touched(kv: TenantKV, extent_id: str, at: float) -> None:
    """A load records its use in the background; wait until the index shows it."""

    def touched() -> bool:
        with kv.context.index.read() as session:
            return session.scalar(select(Extent.last_used_at).where(Extent.id == extent_id)) == at

    wait_for(touched)


def new_tenant(kv: TenantKV, name: str, quota: int = BIG_QUOTA, **kwargs: Any) -> Namespace:
    kv.create_tenant(name, quota_bytes=quota, **kwargs)
    return kv.namespace(name, model=MODEL, layout=MLA_SMALL)


# ---- lifecycle ----------------------------------------------------------------------------------


def test_create_get_list_update_delete(cache: TenantKV, clock: ManualClock) -> None:
    info = cache.create_tenant("acme", quota_bytes=5_000_000, retention={"agent": "1h"})
    assert info.name == "acme"
    assert info.created_at == clock.now
    assert info.key_version == 1 and info.key_versions == (1,)
    assert info.quota_bytes == 5_000_000 and info.used_bytes == 0
    assert info.retention == {"agent": 3600.0, "chat": 7 * 86400.0}  # chat keeps its default
    assert cache.get_tenant("acme") == info
    cache.create_tenant("beta", quota_bytes=1_000_000)
    assert [t.name for t in cache.list_tenants()] == ["acme", "beta"]

    clock.advance(10)
    updated = cache.update_tenant("acme", quota_bytes=6_000_000)
    assert updated.quota_bytes == 6_000_000 and updated.retention == info.retention
    updated = cache.update_tenant("acme", retention={"chat": "2d", "batch": 90})
    assert updated.retention == {"agent": 3600.0, "chat": 2 * 86400.0, "batch": 90.0}
    assert updated.quota_bytes == 6_000_000 and updated.created_at == info.created_at
    assert cache.get_tenant("acme") == updated

    cache.delete_tenant("acme")
    with pytest.raises(TenantNotFoundError):
        cache.get_tenant("acme")
    assert [t.name for t in cache.list_tenants()] == ["beta"]
    assert cache.get_tenant("beta").quota_bytes == 1_000_000


def test_duplicate_tenant_is_refused_and_leaves_the_original(cache: TenantKV) -> None:
    original = cache.create_tenant("acme", quota_bytes=1_000_000, retention={"agent": "1h"})
    with pytest.raises(TenantExistsError):
        cache.create_tenant("acme", quota_bytes=2_000_000)
    assert cache.get_tenant("acme") == original
    assert len(cache.list_tenants()) == 1
    assert data_key_versions(cache, tenant_id(cache, "acme")) == [1]


_TENANT_OPS: dict[str, Callable[[TenantKV, str], object]] = {
    "get": lambda kv, name: kv.get_tenant(name),
    "update_quota": lambda kv, name: kv.update_tenant(name, quota_bytes=1000),
    "update_retention": lambda kv, name: kv.update_tenant(name, retention={"agent": "1d"}),
    "delete": lambda kv, name: kv.delete_tenant(name),
    "rotate": lambda kv, name: kv.rotate_keys(name),
    "retire": lambda kv, name: kv.retire_keys(name),
    "usage": lambda kv, name: kv.usage(name),
    "namespace": lambda kv, name: kv.namespace(name, model=MODEL, layout=MLA_SMALL),
}


@pytest.mark.parametrize("op", sorted(_TENANT_OPS))
@pytest.mark.parametrize("deleted", [False, True], ids=["unknown", "deleted"])
def test_unknown_or_deleted_tenant_raises_not_found(
    cache: TenantKV, op: str, deleted: bool
) -> None:
    cache.create_tenant("other", quota_bytes=1_000_000)
    if deleted:
        cache.create_tenant("gone", quota_bytes=1_000_000)
        _TENANT_OPS[op](cache, "gone")  # positive control: the operation works while it exists
        if op != "delete":
            cache.delete_tenant("gone")
    with pytest.raises(TenantNotFoundError):
        _TENANT_OPS[op](cache, "gone")
    assert [t.name for t in cache.list_tenants()] == ["other"]
    with cache.context.index.read() as session:  # nothing was made for the missing tenant
        assert session.scalar(select(func.count()).select_from(DataKey)) == 1
        assert session.scalar(select(func.count()).select_from(NamespaceRow)) == 0


def test_rotating_a_deleted_tenants_keys_creates_no_key(cache: TenantKV) -> None:
    cache.create_tenant("gone", quota_bytes=1_000_000)
    tid = tenant_id(cache, "gone")
    assert cache.rotate_keys("gone") == 2  # positive control
    cache.delete_tenant("gone")
    with pytest.raises(TenantNotFoundError):
        cache.rotate_keys("gone")
    assert data_key_versions(cache, tid) == []


BAD_QUOTAS: list[Any] = [0, -1, -(2**40), True, False, 1.5, 1024.0, "1024", [1024]]


@pytest.mark.parametrize("quota", BAD_QUOTAS, ids=repr)
def test_bad_quota_is_refused_with_nothing_created_or_changed(cache: TenantKV, quota: Any) -> None:
    with pytest.raises(InvalidRequestError):
        cache.create_tenant("acme", quota_bytes=quota)
    assert cache.list_tenants() == []
    with cache.context.index.read() as session:
        assert session.scalar(select(func.count()).select_from(DataKey)) == 0
    before = cache.create_tenant("acme", quota_bytes=1_000_000)  # positive control
    with pytest.raises(InvalidRequestError):
        cache.update_tenant("acme", quota_bytes=quota)
    assert cache.get_tenant("acme") == before


BAD_DURATIONS: list[Any] = [
    "0d",
    "0",
    "-1h",
    "abc",
    "3x",
    "",
    "1d2h",
    "367d",
    10**9,
    0,
    -5,
    0.0,
    float("nan"),
    float("inf"),
    True,
    None,
    [3600],
]


@pytest.mark.parametrize("duration", BAD_DURATIONS, ids=repr)
def test_bad_retention_duration_is_refused_with_no_partial_state(
    cache: TenantKV, clock: ManualClock, duration: Any
) -> None:
    with pytest.raises(InvalidRequestError):
        cache.create_tenant("acme", quota_bytes=BIG_QUOTA, retention={"agent": duration})
    assert cache.list_tenants() == []
    ns = new_tenant(cache, "acme", retention={"agent": "1h"})  # positive control
    extent_id = store_one(cache, ns, prefix(1), kind="agent")
    before = cache.get_tenant("acme")
    expires = extents_of(cache, tenant_id(cache, "acme"))[extent_id].expires_at
    assert expires == clock.now + 3600
    with pytest.raises(InvalidRequestError):  # one good class and one bad: neither applies
        cache.update_tenant("acme", retention={"chat": "1h", "agent": duration})
    assert cache.get_tenant("acme") == before
    assert extents_of(cache, tenant_id(cache, "acme"))[extent_id].expires_at == expires


BAD_CLASSES: list[Any] = ["Agent", "", "1chat", "chat bot", "chat!", "a" * 65, 5, None, b"chat"]


@pytest.mark.parametrize("kind", BAD_CLASSES, ids=repr)
def test_bad_retention_class_name_is_refused(cache: TenantKV, kind: Any) -> None:
    with pytest.raises(InvalidRequestError):
        cache.create_tenant("acme", quota_bytes=BIG_QUOTA, retention={kind: "1d"})
    assert cache.list_tenants() == []
    before = cache.create_tenant("acme", quota_bytes=BIG_QUOTA)
    with pytest.raises(InvalidRequestError):
        cache.update_tenant("acme", quota_bytes=2 * BIG_QUOTA, retention={kind: "1d"})
    assert cache.get_tenant("acme") == before  # the quota in the same call did not apply either
    ok = cache.update_tenant("acme", retention={"a" * 64: "1d"})  # longest valid name works
    assert ok.retention is not None and ok.retention["a" * 64] == 86400.0


def test_retention_with_more_classes_than_the_index_holds_is_refused(cache: TenantKV) -> None:
    """A tenant's retention is kept as text of at most 1024 characters (PostgreSQL enforces the
    column's length; SQLite would not): more classes are refused the same way on every index."""
    classes = {f"class-{i:02d}-" + "x" * 50: "1d" for i in range(20)}  # ~1400 characters
    with pytest.raises(InvalidRequestError, match="retention"):
        cache.create_tenant("acme", quota_bytes=BIG_QUOTA, retention=classes)
    assert cache.list_tenants() == []
    first = dict(list(classes.items())[:10])
    before = cache.create_tenant("acme", quota_bytes=BIG_QUOTA, retention=first)  # control
    assert before.retention is not None and len(before.retention) == 12
    with pytest.raises(InvalidRequestError, match="retention"):  # the classes add up
        cache.update_tenant("acme", retention=dict(list(classes.items())[10:]))
    assert cache.get_tenant("acme") == before


@pytest.mark.parametrize("retention", [["agent"], "3d", 3, {"agent": "3d"}.items()], ids=repr)
def test_retention_that_is_not_a_mapping_is_refused(cache: TenantKV, retention: Any) -> None:
    with pytest.raises(InvalidRequestError):
        cache.create_tenant("acme", quota_bytes=BIG_QUOTA, retention=retention)
    assert cache.list_tenants() == []


@pytest.mark.parametrize("name", ["", "-acme", ".acme", "a b", "a/b", "é", "a" * 129, 5, None])
def test_bad_tenant_name_is_refused(cache: TenantKV, name: Any) -> None:
    with pytest.raises(InvalidRequestError):
        cache.create_tenant(name, quota_bytes=BIG_QUOTA)
    assert cache.list_tenants() == []
    assert cache.create_tenant("a" * 128, quota_bytes=BIG_QUOTA).name == "a" * 128


@pytest.mark.parametrize("kind", ["batch", "Bad Kind", ""], ids=repr)
def test_store_with_a_class_the_tenant_lacks_stores_nothing(
    cache: TenantKV, cache_root: Path, kind: str
) -> None:
    ns = new_tenant(cache, "acme")
    p = prefix(1)
    with pytest.raises(InvalidRequestError):
        ns.store(p.tokens, p.layers, kind=kind)
    assert ns.lookup(p.tokens) == 0
    assert cache.get_tenant("acme").used_bytes == 0
    assert extent_files(cache_root) == set() and temp_files(cache_root) == []
    assert cache.usage("acme").counters["stored_tokens"] == 0
    # positive control: a tenant that has the class stores with it
    cache.update_tenant("acme", retention={"batch": "1h"})
    assert ns.store(p.tokens, p.layers, kind="batch") == 64
    assert ns.lookup(p.tokens) == 64


def test_store_with_an_unknown_class_is_refused_even_when_already_cached(
    cache: TenantKV,
) -> None:
    ns = new_tenant(cache, "acme")
    p = prefix(1)
    assert ns.store(p.tokens, p.layers) == 64
    with pytest.raises(InvalidRequestError):
        ns.store(p.tokens, p.layers, kind="batch")


# ---- capacity and overcommit ----------------------------------------------------------------


def test_quotas_may_not_exceed_capacity(
    cache_root: Path, clock: ManualClock, master_key: bytes
) -> None:
    with open_cache(cache_root, clock, master_key, capacity_bytes=1000) as kv:
        kv.create_tenant("a", quota_bytes=600)
        with pytest.raises(QuotaExceededError):
            kv.create_tenant("b", quota_bytes=401)
        assert [t.name for t in kv.list_tenants()] == ["a"]
        with kv.context.index.read() as session:
            assert session.scalar(select(func.count()).select_from(DataKey)) == 1
        with pytest.raises(QuotaExceededError):  # the default quota (1 GiB) does not fit either
            kv.create_tenant("b")
        kv.create_tenant("b", quota_bytes=400)  # an exact fit is fine
        with pytest.raises(QuotaExceededError):
            kv.update_tenant("a", quota_bytes=601)
        assert kv.get_tenant("a").quota_bytes == 600
        kv.update_tenant("b", quota_bytes=100)  # freeing room lets the other grow
        assert kv.update_tenant("a", quota_bytes=900).quota_bytes == 900
        assert "overcommit_changed" not in kv.security_events()
        assert kv.info()["capacity_bytes"] == 1000 and kv.info()["allow_overcommit"] is False


def test_concurrent_quota_changes_never_reserve_more_than_the_capacity(
    cache_root: Path, clock: ManualClock, master_key: bytes
) -> None:
    """Two nodes sharing one index create tenants, then raise quotas, all at once. SQLite runs
    their transactions one at a time; PostgreSQL runs them side by side, and must still let
    only what fits through."""
    nodes = [open_cache(cache_root, clock, master_key, capacity_bytes=1000) for _ in range(2)]
    try:

        def at_once(calls: list[Callable[[], object]]) -> list[str]:
            barrier = threading.Barrier(len(calls))
            outcomes: list[str] = []

            def run(call: Callable[[], object]) -> None:
                barrier.wait()
                try:
                    call()
                    outcomes.append("done")
                except QuotaExceededError:
                    outcomes.append("refused")
                except BaseException as err:
                    outcomes.append(repr(err))

            threads = [threading.Thread(target=run, args=(call,)) for call in calls]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            return sorted(outcomes)

        creates = [
            lambda i=i: nodes[i % 2].create_tenant(f"t{i}", quota_bytes=300) for i in range(8)
        ]
        assert at_once(creates) == ["done"] * 3 + ["refused"] * 5
        names = [t.name for t in nodes[0].list_tenants()]
        raises = [
            lambda i=i, name=name: nodes[i % 2].update_tenant(name, quota_bytes=400)
            for i, name in enumerate(names)
        ]
        assert at_once(raises) == ["done"] + ["refused"] * 2  # 900 + 100 = 1000 fits once
        assert sum(t.quota_bytes for t in nodes[1].list_tenants()) == 1000
    finally:
        for node in nodes:
            node.close()


def test_overcommit_is_opt_in_audited_and_persists(
    cache_root: Path, clock: ManualClock, master_key: bytes
) -> None:
    with open_cache(
        cache_root, clock, master_key, capacity_bytes=1000, allow_overcommit=True
    ) as kv:
        assert kv.security_events().get("overcommit_changed") == 1
        kv.create_tenant("a", quota_bytes=800)
        kv.create_tenant("b", quota_bytes=800)  # 1600 > 1000: allowed by the operator
        assert kv.update_tenant("a", quota_bytes=1000).quota_bytes == 1000
    # reopened without the option: the stored policy and capacity apply, and nothing changed
    with tenantkv.open(
        cache_root, durable=False, clock=clock, master_key=KeyEncryptionKey(master_key)
    ) as kv:
        assert kv.allow_overcommit is True and kv.capacity_bytes == 1000
        assert kv.info()["allow_overcommit"] is True
        assert "overcommit_changed" not in kv.security_events()
        kv.create_tenant("c", quota_bytes=900)
    # turning it off while tenants overcommit is refused and changes nothing
    with pytest.raises(QuotaExceededError):
        open_cache(cache_root, clock, master_key, capacity_bytes=1000, allow_overcommit=False)
    with open_cache(cache_root, clock, master_key, capacity_bytes=5000) as kv:
        assert kv.allow_overcommit is True
        assert sum(t.quota_bytes for t in kv.list_tenants()) == 2700
    # turning it off where the quotas fit works and is recorded
    with open_cache(
        cache_root, clock, master_key, capacity_bytes=5000, allow_overcommit=False
    ) as kv:
        assert kv.allow_overcommit is False
        assert kv.security_events().get("overcommit_changed") == 1
        with pytest.raises(QuotaExceededError):
            kv.create_tenant("d", quota_bytes=2301)


def test_capacity_is_index_state_changed_only_by_the_audited_call(
    cache_root: Path, clock: ManualClock, master_key: bytes
) -> None:
    key = KeyEncryptionKey(master_key)
    with open_cache(cache_root, clock, master_key, capacity_bytes=1000) as node_a:
        # a second node opening the same index with its own settings changes nothing
        with tenantkv.open(cache_root, durable=False, clock=clock, master_key=key) as node_b:
            assert node_b.capacity_bytes == 1000 and node_b.allow_overcommit is False
            node_b.set_capacity(capacity_bytes=4000, allow_overcommit=True)
        assert node_a.capacity_bytes == 4000 and node_a.allow_overcommit is True  # shared
        assert node_a.info()["capacity_bytes"] == 4000
        node_a.create_tenant("a", quota_bytes=3000)
        with pytest.raises(QuotaExceededError):
            node_a.set_capacity(capacity_bytes=2000, allow_overcommit=False)
        assert node_a.capacity_bytes == 4000  # refused: nothing changed
        with pytest.raises(tenantkv.InvalidRequestError):
            node_a.set_capacity(capacity_bytes=0)
        lines = list(node_a.context.audit.export(node_a.context.index.read, tenant=None))
        records = [json.loads(line.rsplit(',"', 1)[0] + "}") for line in lines]
        changes = [r["details"] for r in records if r.get("action") == "capacity.update"]
        assert changes[-1] == {"capacity_bytes": 4000, "allow_overcommit": True}
        assert {"capacity_bytes": 2000, "allow_overcommit": False} not in changes
    # the old keyword still works, with a deprecation warning, and is recorded the same way
    with pytest.warns(DeprecationWarning, match="set_capacity"):
        kv = tenantkv.open(cache_root, durable=False, master_key=key, capacity_bytes=5000)
    with kv:
        assert kv.capacity_bytes == 5000


# ---- quota eviction -------------------------------------------------------------------------


def test_over_quota_store_evicts_only_the_tenants_own_lru_extents(
    cache: TenantKV, cache_root: Path, clock: ManualClock, extent_bytes: int
) -> None:
    ns_a = new_tenant(cache, "a", quota=3 * extent_bytes)
    ns_b = new_tenant(cache, "b", quota=3 * extent_bytes)
    pa = [prefix(10 + i) for i in range(4)]
    pb = [prefix(20 + i) for i in range(3)]
    ids_a: list[str] = []
    for i in range(3):
        ids_a.append(store_one(cache, ns_a, pa[i]))
        clock.advance(1)
        store_one(cache, ns_b, pb[i])
        clock.advance(1)
    assert cache.get_tenant("a").used_bytes == 3 * extent_bytes  # full, nothing evicted yet
    assert all(ns_a.lookup(p.tokens) == 64 for p in pa[:3])
    ids_a.append(store_one(cache, ns_a, pa[3]))
    # the victim's own oldest extent went (positive control) ...
    assert ns_a.lookup(pa[0].tokens) == 0
    assert not extent_path(cache_root, ids_a[0]).exists()
    assert [ns_a.lookup(p.tokens) for p in pa[1:]] == [64, 64, 64]
    assert set(extents_of(cache, tenant_id(cache, "a"))) == set(ids_a[1:])
    # ... and the other tenant, as full as it, lost nothing
    assert [ns_b.lookup(p.tokens) for p in pb] == [64, 64, 64]
    assert all(loads_exact(ns_b, p) for p in pb)
    assert cache.get_tenant("b").used_bytes == 3 * extent_bytes
    assert len(extent_files(cache_root)) == 6
    usage_a, usage_b = cache.usage("a").counters, cache.usage("b").counters
    assert usage_a["evicted_extents"] == 1 and usage_a["evicted_bytes"] == extent_bytes
    assert usage_b["evicted_extents"] == 0 and usage_b["evicted_bytes"] == 0


def test_an_evicting_store_returns_normally_and_removes_the_evicted_file(
    cache: TenantKV, cache_root: Path, clock: ManualClock, extent_bytes: int
) -> None:
    ns = new_tenant(cache, "a", quota=extent_bytes)
    first, second = prefix(55), prefix(56)
    first_id = store_one(cache, ns, first)
    clock.advance(1)
    assert ns.store(second.tokens, second.layers) == 64
    assert ns.lookup(first.tokens) == 0 and ns.lookup(second.tokens) == 64
    assert not extent_path(cache_root, first_id).exists()
    assert len(extent_files(cache_root)) == 1
    usage = cache.usage("a").counters
    assert usage["stored_tokens"] == 128 and usage["evicted_extents"] == 1


def test_lru_order_counts_loads(cache: TenantKV, clock: ManualClock, extent_bytes: int) -> None:
    ns = new_tenant(cache, "a", quota=3 * extent_bytes)
    ps = [prefix(30 + i) for i in range(4)]
    ids: list[str] = []
    for p in ps[:3]:
        ids.append(store_one(cache, ns, p))
        clock.advance(10)
    assert loads_exact(ns, ps[0])  # the oldest store is now the most recently used
    wait_touched(cache, ids[0], clock.now)
    clock.advance(10)
    store_one(cache, ns, ps[3])
    assert ns.lookup(ps[1].tokens) == 0  # the least recently used went
    assert [ns.lookup(p.tokens) for p in (ps[0], ps[2], ps[3])] == [64, 64, 64]
    assert loads_exact(ns, ps[0])


def test_lookup_alone_does_not_refresh_lru(
    cache: TenantKV, clock: ManualClock, extent_bytes: int
) -> None:
    ns = new_tenant(cache, "a", quota=2 * extent_bytes)
    ps = [prefix(40 + i) for i in range(3)]
    for p in ps[:2]:
        store_one(cache, ns, p)
        clock.advance(10)
    assert ns.lookup(ps[0].tokens) == 64  # a lookup is not a use
    clock.advance(10)
    store_one(cache, ns, ps[2])
    assert ns.lookup(ps[0].tokens) == 0
    assert ns.lookup(ps[1].tokens) == 64


def test_store_larger_than_the_whole_quota_is_refused_and_stores_nothing(
    cache: TenantKV, cache_root: Path, clock: ManualClock, extent_bytes: int
) -> None:
    ns = new_tenant(cache, "a", quota=extent_bytes)
    small = prefix(50)
    kept = store_one(cache, ns, small)  # exactly the quota: fits
    assert cache.get_tenant("a").used_bytes == extent_bytes
    clock.advance(10)
    big = prefix(51, blocks=2)
    with pytest.raises(QuotaExceededError):
        ns.store(big.tokens, big.layers)
    assert ns.lookup(big.tokens) == 0
    assert ns.lookup(small.tokens) == 64  # nothing was evicted for a store that cannot fit
    assert set(extents_of(cache, tenant_id(cache, "a"))) == {kept}
    assert extent_files(cache_root) == {kept} and temp_files(cache_root) == []
    assert cache.security_events().get("quota_refused") == 1
    assert cache.usage("a").counters["evicted_extents"] == 0
    assert cache.usage("a").counters["stored_tokens"] == 64


def test_extent_read_by_an_open_load_is_never_evicted(
    cache: TenantKV, cache_root: Path, clock: ManualClock, extent_bytes: int
) -> None:
    ns = new_tenant(cache, "a", quota=2 * extent_bytes)
    ps = [prefix(60 + i) for i in range(4)]
    ids = [store_one(cache, ns, ps[0])]
    clock.advance(10)
    ids.append(store_one(cache, ns, ps[1]))
    clock.advance(10)
    stream = ns.load(ps[0].tokens)  # open, not iterated: p0 (the LRU) is pinned
    try:
        ids.append(store_one(cache, ns, ps[2]))  # evicts something else: p1
        assert ns.lookup(ps[1].tokens) == 0 and not extent_path(cache_root, ids[1]).exists()
        assert ns.lookup(ps[0].tokens) == 64 and extent_path(cache_root, ids[0]).exists()
        clock.advance(10)
        with ns.load(ps[2].tokens) as second:  # now both extents are pinned: nothing can go
            files = extent_files(cache_root)
            with pytest.raises(QuotaExceededError):
                ns.store(ps[3].tokens, ps[3].layers)
            assert ns.lookup(ps[3].tokens) == 0
            assert extent_files(cache_root) == files and temp_files(cache_root) == []
            assert all(layers_equal(a, b) for (_, a), b in zip(second, ps[2].layers, strict=True))
        got = [layer for _, layer in stream]
        assert all(layers_equal(a, b) for a, b in zip(got, ps[0].layers, strict=True))
        assert len(got) == MLA_SMALL.num_layers
    finally:
        stream.close()
    assert cache.security_events().get("quota_refused") == 1
    # positive control: once the loads are done the same store evicts and succeeds
    clock.advance(10)
    assert ns.store(ps[3].tokens, ps[3].layers) == 64
    assert cache.get_tenant("a").used_bytes <= 2 * extent_bytes


def test_lowering_the_quota_evicts_down_to_it(
    cache: TenantKV, cache_root: Path, clock: ManualClock, extent_bytes: int
) -> None:
    ns = new_tenant(cache, "a", quota=4 * extent_bytes)
    other = new_tenant(cache, "b", quota=4 * extent_bytes)
    ps = [prefix(70 + i) for i in range(4)]
    ids: list[str] = []
    for p in ps:
        ids.append(store_one(cache, ns, p))
        clock.advance(10)
    other_id = store_one(cache, other, prefix(79))
    info = cache.update_tenant("a", quota_bytes=2 * extent_bytes)
    assert info.quota_bytes == 2 * extent_bytes and info.used_bytes == 2 * extent_bytes
    assert [ns.lookup(p.tokens) for p in ps] == [0, 0, 64, 64]
    assert not extent_path(cache_root, ids[0]).exists()
    assert not extent_path(cache_root, ids[1]).exists()
    assert extent_files(cache_root) == {ids[2], ids[3], other_id}
    usage = cache.usage("a").counters
    assert usage["evicted_extents"] == 2 and usage["evicted_bytes"] == 2 * extent_bytes
    assert cache.usage("b").counters["evicted_extents"] == 0
    # the operator's quota takes effect at once even over running loads: the LRU extent leaves
    # the index now, and its bytes stay until the load that reads it ends
    with ns.load(ps[2].tokens) as first, ns.load(ps[3].tokens) as second:
        info = cache.update_tenant("a", quota_bytes=extent_bytes)
        assert info.quota_bytes == extent_bytes and info.used_bytes == extent_bytes
        assert [ns.lookup(p.tokens) for p in ps[2:]] == [0, 64]
        assert extent_path(cache_root, ids[2]).exists()  # still being read
        assert all(layers_equal(a, b) for (_, a), b in zip(first, ps[2].layers, strict=True))
        assert all(layers_equal(a, b) for (_, a), b in zip(second, ps[3].layers, strict=True))
    wait_for(lambda: not extent_path(cache_root, ids[2]).exists())  # the lease's end frees it
    assert extent_files(cache_root) == {ids[3], other_id}
    assert cache.security_events().get("segment_open_failed") is None


def test_store_prefers_evicting_expired_extents_over_lru(
    cache: TenantKV, clock: ManualClock, extent_bytes: int
) -> None:
    ns = new_tenant(cache, "a", quota=2 * extent_bytes, retention={"agent": "1h"})
    old_chat, new_agent, third = prefix(80), prefix(81), prefix(82)
    store_one(cache, ns, old_chat, kind="chat")  # least recently used, 7 days
    clock.advance(100)
    store_one(cache, ns, new_agent, kind="agent")  # more recent, but expires after an hour
    clock.advance(3600)
    store_one(cache, ns, third)
    assert ns.lookup(old_chat.tokens) == 64 and ns.lookup(third.tokens) == 64
    assert ns.lookup(new_agent.tokens) == 0
    usage = cache.usage("a").counters
    assert usage["expired_extents"] == 1 and usage["expired_bytes"] == extent_bytes
    assert usage["evicted_extents"] == 0


# ---- keys -----------------------------------------------------------------------------------


def test_rotation_new_writes_use_the_new_version_and_old_data_stays_readable(
    cache: TenantKV,
) -> None:
    ns = new_tenant(cache, "a")
    old, new = prefix(90), prefix(91)
    old_id = store_one(cache, ns, old)
    assert cache.rotate_keys("a") == 2
    info = cache.get_tenant("a")
    assert info.key_version == 2 and info.key_versions == (1, 2)
    new_id = store_one(cache, ns, new)
    extents = extents_of(cache, tenant_id(cache, "a"))
    assert extents[old_id].key_version == 1 and extents[new_id].key_version == 2
    assert loads_exact(ns, old) and loads_exact(ns, new)
    assert cache.rotate_keys("a") == 3
    third_id = store_one(cache, ns, prefix(92))
    assert extents_of(cache, tenant_id(cache, "a"))[third_id].key_version == 3
    # another tenant's versions are its own
    new_tenant(cache, "b")
    assert cache.get_tenant("b").key_version == 1


def test_retire_reseals_old_extents_and_destroys_old_keys(
    cache: TenantKV, cache_root: Path
) -> None:
    ns = new_tenant(cache, "a")
    ps = [prefix(100), prefix(101, blocks=2)]
    old_ids = [store_one(cache, ns, p) for p in ps]
    cache.rotate_keys("a")
    current = prefix(102)
    current_id = store_one(cache, ns, current)
    tid = tenant_id(cache, "a")
    outcome = cache.retire_keys("a")
    assert outcome == {
        "resealed": 2,
        "dropped": 0,
        "skipped_in_use": 0,
        "retired_versions": [1],
        "extents_on_old_keys": 0,
        "scrub_complete": True,
    }
    extents = extents_of(cache, tid)
    assert len(extents) == 3 and current_id in extents
    assert not set(old_ids) & set(extents)  # re-sealed into new extents ...
    assert {e.key_version for e in extents.values()} == {2}
    assert not any(extent_path(cache_root, i).exists() for i in old_ids)  # ... old files gone
    assert extent_files(cache_root) == set(extents)
    assert data_key_versions(cache, tid) == [2]
    assert cache.get_tenant("a").key_versions == (2,)
    assert all(loads_exact(ns, p) for p in [*ps, current])
    assert cache.security_events().get("segment_open_failed") is None
    again = cache.retire_keys("a")
    assert again["resealed"] == 0 and again["retired_versions"] == []


def test_retire_skips_an_extent_an_open_load_reads(cache: TenantKV) -> None:
    ns = new_tenant(cache, "a")
    busy, idle = prefix(110), prefix(111)
    busy_id, idle_id = store_one(cache, ns, busy), store_one(cache, ns, idle)
    cache.rotate_keys("a")
    tid = tenant_id(cache, "a")
    with ns.load(busy.tokens) as stream:
        outcome = cache.retire_keys("a")
        assert outcome["skipped_in_use"] == 1 and outcome["resealed"] == 1
        assert outcome["retired_versions"] == [] and outcome["extents_on_old_keys"] == 1
        extents = extents_of(cache, tid)
        assert extents[busy_id].key_version == 1  # still where the load reads it
        assert idle_id not in extents
        assert data_key_versions(cache, tid) == [1, 2]  # its version is kept
        got = [layer for _, layer in stream]
    assert all(layers_equal(a, b) for a, b in zip(got, busy.layers, strict=True))
    assert loads_exact(ns, busy) and loads_exact(ns, idle)
    outcome = cache.retire_keys("a")  # run again later to finish
    assert outcome["resealed"] == 1 and outcome["retired_versions"] == [1]
    assert data_key_versions(cache, tid) == [2]
    assert loads_exact(ns, busy)


# ---- crypto-shredding -----------------------------------------------------------------------


@dataclass(frozen=True)
class SealedSegment:
    extent_id: str
    slot: int
    layer: int
    position: int
    block_key: bytes
    sealed: bytes


@dataclass(frozen=True)
class ExtentRecord:
    extent_id: str
    namespace_id: bytes
    key_version: int
    suite: CipherSuite
    salt: bytes
    geometry: ExtentGeometry


def record_extents(
    kv: TenantKV, tid: bytes, aside: Path
) -> tuple[list[ExtentRecord], list[SealedSegment]]:
    """The tenant's extents as the index describes them, and every referenced sealed segment,
    read from copies of the files taken now."""
    records: list[ExtentRecord] = []
    segments: list[SealedSegment] = []
    with kv.context.index.read() as session:
        extents = session.scalars(select(Extent).where(Extent.tenant_id == tid)).all()
        blocks = session.execute(
            select(Block.extent_id, Block.slot, Block.position, Block.block_key).where(
                Block.extent_id.in_([e.id for e in extents])
            )
        ).all()
    for extent in extents:
        suite = CipherSuite(extent.suite)
        geometry = ExtentGeometry(extent.num_blocks, extent.num_layers, extent.segment_bytes, suite)
        records.append(
            ExtentRecord(
                extent.id, extent.namespace_id, extent.key_version, suite, extent.salt, geometry
            )
        )
        copy = aside / f"{extent.id}.tkx"
        shutil.copyfile(extent_path(kv.config.root, extent.id), copy)
        data = copy.read_bytes()
        assert len(data) == geometry.total_bytes
        for extent_id, slot, position, block_key in blocks:
            if extent_id != extent.id:
                continue
            for layer in range(geometry.num_layers):
                start = geometry.offset(layer, slot)
                segments.append(
                    SealedSegment(
                        extent.id,
                        slot,
                        layer,
                        position,
                        block_key,
                        data[start : start + geometry.sealed_bytes],
                    )
                )
    return records, segments


def try_open(
    data_key: bytes, record: ExtentRecord, context: SegmentContext, segment: SealedSegment
) -> bytes:
    cipher = ExtentCipher(data_key, record.salt, context, record.suite)
    out = bytearray(record.geometry.segment_bytes)
    cipher.open_into(
        segment.slot, segment.layer, segment.block_key, memoryview(segment.sealed), memoryview(out)
    )
    return bytes(out)


def test_delete_tenant_crypto_shreds_its_data(
    cache: TenantKV, cache_root: Path, tmp_path: Path, master_key: bytes
) -> None:
    kek = KeyEncryptionKey(master_key)
    victim = new_tenant(cache, "victim")
    scoped = cache.namespace("victim", model=MODEL, layout=MLA_SMALL, scope="s1")
    bystander = new_tenant(cache, "bystander")
    p1, p2, p3 = prefix(120, blocks=2), prefix(121), prefix(122)
    victim.store(p1.tokens, p1.layers)
    cache.rotate_keys("victim")  # two key versions to shred
    scoped.store(p2.tokens, p2.layers)
    bystander.store(p1.tokens, p1.layers)  # same tokens, its own keys
    cache.rotate_keys("bystander")
    bystander.store(p3.tokens, p3.layers)
    vid, bid = tenant_id(cache, "victim"), tenant_id(cache, "bystander")
    aside = tmp_path / "aside"
    aside.mkdir()
    records, segments = record_extents(cache, vid, aside)
    by_id = {r.extent_id: r for r in records}
    assert {r.key_version for r in records} == {1, 2} and len(segments) == 3 * 3
    with cache.context.index.read() as session:
        victim_keys: dict[int, bytes] = {
            version: wrapped
            for version, wrapped in session.execute(
                select(DataKey.version, DataKey.wrapped_key).where(DataKey.tenant_id == vid)
            )
        }
    layers_by_namespace = {victim.identity.namespace_id: p1, scoped.identity.namespace_id: p2}

    # positive control: before deletion the tenant's own key opens every segment, exactly
    for segment in segments:
        record = by_id[segment.extent_id]
        key = kek.unwrap(victim_keys[record.key_version], data_key_context(vid, record.key_version))
        context = SegmentContext(vid, record.key_version, record.namespace_id)
        plain = try_open(key, record, context, segment)
        source = layers_by_namespace[record.namespace_id].layers[segment.layer]
        assert isinstance(source, torch.Tensor)
        rows = slice(64 * segment.position, 64 * (segment.position + 1))
        expected = torch.frombuffer(bytearray(plain), dtype=MLA_SMALL.dtype).view(64, -1)
        assert torch.equal(expected, source[rows])

    cache.delete_tenant("victim")

    with cache.context.index.read() as session:  # keys and index rows are gone
        assert (
            session.scalar(
                select(func.count()).select_from(DataKey).where(DataKey.tenant_id == vid)
            )
            == 0
        )
        assert (
            session.scalar(
                select(func.count()).select_from(NamespaceRow).where(NamespaceRow.tenant_id == vid)
            )
            == 0
        )
        assert (
            session.scalar(select(func.count()).select_from(Extent).where(Extent.tenant_id == vid))
            == 0
        )
        assert (
            session.scalar(select(func.count()).select_from(Usage).where(Usage.tenant_id == vid))
            == 0
        )
        assert (
            session.scalar(
                select(func.count()).select_from(Block).where(Block.extent_id.in_(list(by_id)))
            )
            == 0
        )
        remaining = session.execute(
            select(DataKey.tenant_id, DataKey.version, DataKey.wrapped_key)
        ).all()
    assert not any(extent_path(cache_root, i).exists() for i in by_id)  # files gone ...
    assert extent_files(cache_root) == set(extents_of(cache, bid))  # ... the bystander's stay
    assert {(t, v) for t, v, _ in remaining} == {(bid, 1), (bid, 2)}

    # nothing left in the index opens the copied bytes
    opened = 0
    for owner, version, wrapped in remaining:
        key = kek.unwrap(wrapped, data_key_context(owner, version))  # control: unwrapping works
        for victim_version in (1, 2):  # no remaining blob is the victim's key under another name
            with pytest.raises(SealOpenError):
                kek.unwrap(wrapped, data_key_context(vid, victim_version))
        for segment in segments:
            record = by_id[segment.extent_id]
            for context in (
                SegmentContext(vid, record.key_version, record.namespace_id),
                SegmentContext(owner, version, record.namespace_id),
            ):
                with pytest.raises(SealOpenError):
                    try_open(key, record, context, segment)
                opened += 1
    assert opened == len(remaining) * len(segments) * 2

    # the bystander is untouched, and a new tenant of the same name sees nothing old
    assert loads_exact(bystander, p1) and loads_exact(bystander, p3)
    reborn = new_tenant(cache, "victim")
    assert reborn.identity.tenant_id != vid
    assert reborn.lookup(p1.tokens) == 0 and reborn.lookup(p2.tokens) == 0
    with pytest.raises(CacheMissError):
        reborn.load(p1.tokens)
    reborn_scoped = cache.namespace("victim", model=MODEL, layout=MLA_SMALL, scope="s1")
    assert reborn_scoped.lookup(p2.tokens) == 0
    assert cache.get_tenant("victim").used_bytes == 0
    assert cache.usage("victim").counters["stored_tokens"] == 0
    assert reborn.store(p1.tokens, p1.layers) == 128  # positive control: it caches its own
    assert loads_exact(reborn, p1)
    # the old handle cannot write into the dead tenant
    with pytest.raises(TenantNotFoundError):
        victim.store(p3.tokens, p3.layers)


def test_a_stale_handle_of_a_deleted_tenant_does_not_break_metering(cache: TenantKV) -> None:
    stale = new_tenant(cache, "gone")
    other = new_tenant(cache, "other")
    p = prefix(130)
    other.store(p.tokens, p.layers)
    cache.delete_tenant("gone")
    assert stale.lookup(p.tokens) == 0  # a request racing the deletion
    assert other.lookup(p.tokens) == 64
    assert cache.usage("other").counters["hit_tokens"] == 64


def test_no_copy_of_a_deleted_tenants_wrapped_key_stays_on_disk(
    cache: TenantKV, cache_root: Path, index: Index
) -> None:
    """On SQLite every file under the root is scanned (index, WAL, extents). A PostgreSQL
    server's files are out of reach: there every row of the index is scanned, which shows the
    deletion is complete but says nothing of dead tuples or WAL segments on the server."""
    ns = new_tenant(cache, "gone")
    p = prefix(140)
    ns.store(p.tokens, p.layers)
    tid = tenant_id(cache, "gone")
    with cache.context.index.read() as session:
        wrapped = session.scalar(select(DataKey.wrapped_key).where(DataKey.tenant_id == tid))
    assert wrapped is not None

    def holding() -> list[str]:
        places = {str(f): f.read_bytes() for f in cache_root.rglob("*") if f.is_file()}
        if not index.is_sqlite:
            places["index rows"] = index.stored_bytes(cache.context.index.url)
        return [name for name, data in places.items() if wrapped in data]

    assert holding()  # positive control: the scan finds it
    cache.delete_tenant("gone")
    assert holding() == []
