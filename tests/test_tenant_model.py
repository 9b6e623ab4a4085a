"""Stateful model test of tenants (DESIGN.md §4.1, README "tenants, quotas, retention"):

Three tenants with one or two scopes each, a fake clock, and a plain-Python model of what must be
cached: per namespace which extents exist (the blocks each covers, its retention class, creation
time, last use, size, key version). The model applies the documented rules -- each store writes
one extent of the new blocks; a store over the quota evicts the same tenant's extents whole,
expired ones first, then least recently used (a load refreshes use and retention; ties: most
recently created first); an extent expires ``retention[kind]`` seconds after its last store or
load, and an expired block is a miss; quotas reserve capacity -- and every step checks lookups,
exact loaded bytes, store results, usage counters, bytes used, key versions, block positions and
the files in the block store against it.

The clock moves forward by at least a second before every operation, so no two extents share a
creation time and LRU ties only arise between extents refreshed by the same load (where the
documented tie-break applies).

Two regimes run the same machine: ``roomy`` quotas (no eviction can happen) and ``tight`` quotas
of a few extents (eviction on most runs).
"""

from __future__ import annotations

import functools
import itertools
import logging
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

import tenantkv
from tenantkv import BLOCK_TOKENS, Layer, Namespace, TenantKV
from tenantkv.components.metering import FIELDS
from tests.indexes import Index

from .helpers import MLA_SMALL, ManualClock, load_all, random_layers, random_tokens

LAYOUT = MLA_SMALL
MODEL_NAME = "model-test"
HOUR = 3600.0
DAY = 24 * HOUR
RETENTION = {"agent": "3d", "chat": "7d"}
RETENTION_SECONDS = {"agent": 3 * DAY, "chat": 7 * DAY}
KINDS = ("agent", "chat")
# Fake epoch seconds far before any real file time, so GC's orphan sweep (which compares file
# mtimes with the clock) never considers a file old enough to remove.
START = 1_000_000.0

# ---- test plumbing ------------------------------------------------------------------------------


class BackgroundWork:
    """Runs the cache's background bookkeeping (a load records its use after it closes) on the
    cache's own pool as usual, but lets the test wait for it, so the next operation sees the
    load's refresh deterministically."""

    def __init__(self, kv: TenantKV) -> None:
        self._kv = kv
        self._pending: list[Future[object]] = []
        kv.context.runtime.submit_background = self._submit  # type: ignore[method-assign]

    def _submit(self, task: Callable[..., object], *args: object) -> None:
        self._pending.append(self._kv.context.runtime.load_executor.submit(task, *args))

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()


def call(operation: Callable[[], Any]) -> Any:
    """The result of ``operation``, or the type name of the tenantkv error it raised."""
    try:
        return operation()
    except tenantkv.TenantKVError as err:
        return type(err).__name__


@functools.cache
def extent_sizes() -> tuple[int, int]:
    """(fixed bytes, bytes per block) of an extent in LAYOUT, learnt from ``used_bytes``."""
    with (
        tempfile.TemporaryDirectory(prefix="tenantkv-size-") as root,
        tenantkv.open(root, durable=False, workers=1, clock=ManualClock(START)) as kv,
    ):
        kv.create_tenant("probe", quota_bytes=2**24)
        ns = kv.namespace("probe", model=MODEL_NAME, layout=LAYOUT)
        ns.store(random_tokens(BLOCK_TOKENS, seed=1), random_layers(LAYOUT, BLOCK_TOKENS))
        one = kv.get_tenant("probe").used_bytes
        ns.store(random_tokens(2 * BLOCK_TOKENS, seed=2), random_layers(LAYOUT, 2 * BLOCK_TOKENS))
        two = kv.get_tenant("probe").used_bytes - one
    per_block = two - one
    assert per_block > 0 and one > per_block
    return one - per_block, per_block


def extent_bytes(num_blocks: int) -> int:
    fixed, per_block = extent_sizes()
    return fixed + num_blocks * per_block


def layer_bytes(layer: Layer) -> bytes:
    """The raw bytes of a loaded layer (MLA: one tensor; MHA: k then v)."""
    parts = [layer] if isinstance(layer, torch.Tensor) else list(layer)
    return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)


# ---- token pool ---------------------------------------------------------------------------------

# Two distinct 64-token blocks; a sequence is a chain of them plus a partial tail, so shared
# prefixes and extensions are frequent. A block's model key is the chain up to and including it.
POOL_BLOCKS: list[list[int]] = [random_tokens(BLOCK_TOKENS, seed=100 + i) for i in range(2)]
TAIL: list[int] = random_tokens(BLOCK_TOKENS - 1, seed=99)

Chain = tuple[int, ...]
Seq = tuple[Chain, int]  # (pool block indices, tail length)

SEQUENCES: st.SearchStrategy[Seq] = st.tuples(
    st.lists(st.integers(0, len(POOL_BLOCKS) - 1), max_size=4).map(tuple),
    st.sampled_from([0, 1, BLOCK_TOKENS - 1]),
)


def tokens_of(seq: Seq) -> list[int]:
    chain, tail = seq
    tokens: list[int] = []
    for index in chain:
        tokens.extend(POOL_BLOCKS[index])
    return tokens + TAIL[:tail]


def keys_of(seq: Seq) -> list[Chain]:
    chain, _tail = seq
    return [chain[: k + 1] for k in range(len(chain))]


# ---- the model ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Space:
    tenant: str
    scope: str | None

    @property
    def meter_scope(self) -> str:
        return self.scope or ""


TENANTS = ("t0", "t1", "t2")
# t0 has a tenant-wide and a scoped namespace; t1 reuses the scope name "s1" (must not matter).
SPACES = (Space("t0", None), Space("t0", "s1"), Space("t1", "s1"), Space("t2", None))
# Namespace 0 gets half of the operations, so its entries are re-used, extended and expire.
SPACE_CHOICE = st.sampled_from([0, 0, 0, 1, 2, 3])


@dataclass
class ExtentModel:
    ident: int
    space: int
    kind: str
    data: dict[Chain, list[torch.Tensor]]  # block key -> that block's rows, per layer
    size: int
    created: float
    last_used: float
    expires: float
    key_version: int


@dataclass
class TenantModel:
    quota: int
    retention: dict[str, float] = field(default_factory=lambda: dict(RETENTION_SECONDS))
    key_version: int = 1
    key_versions: set[int] = field(default_factory=lambda: {1})
    usage: dict[str, Counter[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Regime:
    """Quotas of one run: initial ones, what ``update`` draws, and the store's capacity."""

    name: str
    unit: Callable[[], int]  # bytes of one quota unit
    initial: dict[str, int]  # tenant -> units
    update_offset: int  # an update to ``u`` units sets ``u + update_offset`` units
    capacity: int  # units

    def quota(self, units: int) -> int:
        return units * self.unit()


# Largest footprint a tenant can reach: 2 namespaces x (2 + 4 + 8 + 16) distinct blocks (plus
# expired extents whose blocks were stored again, each at most 4 blocks; a run has at most
# 30 steps), about 4 MB in LAYOUT, so quotas of 8 MiB and more never evict.
ROOMY = Regime("roomy", lambda: 2**20, {"t0": 16, "t1": 8, "t2": 8}, 7, 40)
# One unit is a one-block extent; a 4-block store needs a little less than 4 units.
TIGHT = Regime("tight", lambda: extent_bytes(1), {"t0": 5, "t1": 3, "t2": 2}, 0, 12)


class TenantMachine(RuleBasedStateMachine):
    regime: Regime = ROOMY
    stored = Bundle("stored")

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory(prefix="tenantkv-model-")
        self.clock = ManualClock(START)
        self.kv = tenantkv.open(
            self._dir.name,
            durable=False,
            workers=2,
            capacity_bytes=self.regime.quota(self.regime.capacity),
            clock=self.clock,
        )
        self.background = BackgroundWork(self.kv)
        self.seeds = itertools.count()
        self.idents = itertools.count()
        self.extents: dict[int, ExtentModel] = {}
        self.index: list[dict[Chain, int]] = [{} for _ in SPACES]  # block key -> extent ident
        self.tenants: dict[str, TenantModel] = {}
        self.handles: list[Namespace] = []
        for name in TENANTS:
            quota = self.regime.quota(self.regime.initial[name])
            self.kv.create_tenant(name, quota_bytes=quota, retention=RETENTION)
            self.tenants[name] = TenantModel(quota)
        self.handles = [self.open_space(space) for space in SPACES]
        note(f"regime={self.regime.name} extent_sizes={extent_sizes()}")

    def teardown(self) -> None:
        try:
            self.kv.close()
        finally:
            self._dir.cleanup()

    def open_space(self, space: Space) -> Namespace:
        return self.kv.namespace(space.tenant, model=MODEL_NAME, layout=LAYOUT, scope=space.scope)

    # ---- model helpers --------------------------------------------------------------------------

    def tick(self) -> float:
        return self.clock.advance(1.0)

    def alive(self, space: int, key: Chain, now: float) -> bool:
        ident = self.index[space].get(key)
        return ident is not None and self.extents[ident].expires > now

    def cached_count(self, space: int, keys: Sequence[Chain], now: float) -> int:
        count = 0
        for key in keys:
            if not self.alive(space, key, now):
                break
            count += 1
        return count

    def meter(self, space: int, **counts: int) -> None:
        spec = SPACES[space]
        usage = self.tenants[spec.tenant].usage
        usage.setdefault(spec.meter_scope, Counter()).update(counts)

    def extents_of(self, tenant: str) -> list[ExtentModel]:
        return [e for e in self.extents.values() if SPACES[e.space].tenant == tenant]

    def remove(self, extent: ExtentModel, *, metered: bool = True) -> None:
        del self.extents[extent.ident]
        index = self.index[extent.space]
        for key in extent.data:
            if index.get(key) == extent.ident:
                del index[key]
        if metered:
            if extent.expires <= self.clock():
                self.meter(extent.space, expired_extents=1, expired_bytes=extent.size)
            else:
                self.meter(extent.space, evicted_extents=1, evicted_bytes=extent.size)

    def make_room(self, tenant: str, quota: int, now: float, keep: int | None = None) -> None:
        """Evict ``tenant``'s extents (expired first, then LRU, then newest) until it fits."""
        mine = self.extents_of(tenant)
        used = sum(e.size for e in mine)
        for extent in sorted(mine, key=lambda e: (e.expires > now, e.last_used, -e.created)):
            if used <= quota:
                break
            if extent.ident == keep:
                continue
            note(f"model evicts extent {extent.ident} ({list(extent.data)}) of {tenant}")
            event("eviction of an expired extent" if extent.expires <= now else "LRU eviction")
            self.remove(extent)
            used -= extent.size
        assert used <= quota

    def expected_layers(self, space: int, keys: Sequence[Chain]) -> list[torch.Tensor]:
        blocks = [self.extents[self.index[space][key]].data[key] for key in keys]
        return [torch.cat([block[layer] for block in blocks]) for layer in range(LAYOUT.num_layers)]

    def collect(self) -> None:
        """Run GC on the cache and the model (expired extents go, metered as expired)."""
        now = self.clock()
        expired = [e for e in self.extents.values() if e.expires <= now]
        report = self.kv.gc(orphan_grace=0)
        note(f"gc -> {report}; model expires {[e.ident for e in expired]}")
        assert report.expired_extents == len(expired)
        assert report.expired_bytes == sum(e.size for e in expired)
        for extent in expired:
            self.remove(extent)

    def lookup_checked(self, space: int, seq: Seq) -> int:
        now = self.clock()
        tokens = tokens_of(seq)
        expected = self.cached_count(space, keys_of(seq), now) * BLOCK_TOKENS
        got = self.handles[space].lookup(tokens)
        note(f"lookup ns{space} {seq} -> {got} (model {expected})")
        assert got == expected
        self.meter(space, hit_tokens=got, miss_tokens=len(tokens) - got)
        return got

    # ---- rules ----------------------------------------------------------------------------------

    @rule(
        target=stored,
        space=SPACE_CHOICE,
        seq=SEQUENCES,
        kind=st.sampled_from(KINDS),
    )
    def store(self, space: int, seq: Seq, kind: str) -> tuple[int, Seq]:
        return self.store_checked(space, seq, kind)

    def store_checked(self, space: int, seq: Seq, kind: str) -> tuple[int, Seq]:
        now = self.tick()
        tenant = self.tenants[SPACES[space].tenant]
        keys = keys_of(seq)
        first = self.cached_count(space, keys, now)
        positions = [i for i in range(first, len(keys)) if not self.alive(space, keys[i], now)]
        size = extent_bytes(len(positions))
        expected: int | str
        if not positions:
            expected = 0
        elif size > tenant.quota:
            expected = "QuotaExceededError"
        else:
            expected = len(positions) * BLOCK_TOKENS
        tokens = tokens_of(seq)
        layers = random_layers(LAYOUT, len(tokens), seed=next(self.seeds))
        got = call(lambda: self.handles[space].store(tokens, layers, kind=kind))
        note(f"store ns{space} {seq} {kind} -> {got} (model {expected}, {size} B)")
        assert got == expected
        if isinstance(expected, int) and expected:
            ident = next(self.idents)
            data = {}
            for i in positions:
                rows = slice(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)
                data[keys[i]] = [
                    layer[rows].clone() for layer in layers if isinstance(layer, torch.Tensor)
                ]
                # A block held by an expired, uncollected extent moves to the new one; the old
                # extent keeps its size (and counts against the quota) until GC or eviction.
                if keys[i] in self.index[space]:
                    event("re-store of an expired, uncollected block")
                self.index[space][keys[i]] = ident
            self.extents[ident] = ExtentModel(
                ident=ident,
                space=space,
                kind=kind,
                data=data,
                size=size,
                created=now,
                last_used=now,
                expires=now + tenant.retention[kind],
                key_version=tenant.key_version,
            )
            self.meter(space, stored_tokens=expected, stored_bytes=size)
            self.make_room(SPACES[space].tenant, tenant.quota, now, keep=ident)
        return space, seq

    @rule(
        target=stored,
        entry=stored,
        hours=st.sampled_from([1, 71, 72, 100, 167, 168, 200]),
        kind=st.sampled_from(KINDS),
    )
    def store_later(self, entry: tuple[int, Seq], hours: int, kind: str) -> tuple[int, Seq]:
        """Store what a namespace stored before again, some hours later (often after it
        expired, or in the other retention class)."""
        self.advance(hours, 0)
        return self.store_checked(*entry, kind)

    @rule(space=SPACE_CHOICE, seq=SEQUENCES)
    def lookup(self, space: int, seq: Seq) -> None:
        self.tick()
        self.lookup_checked(space, seq)

    @rule(space=SPACE_CHOICE, seq=SEQUENCES)
    def load(self, space: int, seq: Seq) -> None:
        """Load the model's cached prefix (exact bytes); one block more is a CacheMissError."""
        now = self.tick()
        keys = keys_of(seq)
        tokens = tokens_of(seq)
        ns = self.handles[space]
        cached = self.cached_count(space, keys, now)
        note(f"load ns{space} {seq} cached blocks={cached}")
        if cached:
            got = load_all(ns, tokens[: cached * BLOCK_TOKENS])
            self.background.wait()
            want = self.expected_layers(space, keys[:cached])
            assert len(got) == len(want)
            for index, (g, w) in enumerate(zip(got, want, strict=True)):
                assert isinstance(g, torch.Tensor) and g.dtype == w.dtype, f"layer {index}"
                assert layer_bytes(g) == layer_bytes(w), f"layer {index} differs"
            # Bytes served: the decoded tensors the caller got, counted from them.
            served = sum(g.numel() * g.element_size() for g in got)
            self.meter(space, served_tokens=cached * BLOCK_TOKENS, served_bytes=served)
            retention = self.tenants[SPACES[space].tenant].retention
            for ident in {self.index[space][key] for key in keys[:cached]}:
                extent = self.extents[ident]
                extent.last_used = now
                extent.expires = now + retention[extent.kind]
        if len(keys) > cached:
            with pytest.raises(tenantkv.CacheMissError):
                ns.load(tokens[: (cached + 1) * BLOCK_TOKENS])

    @rule(
        hours=st.one_of(st.sampled_from([24, 72, 168]), st.integers(1, 8 * 24)),
        seconds=st.sampled_from([0, -1, -2]),
    )
    def advance(self, hours: int, seconds: int) -> None:
        """Hours to days; the offsets make expiry boundaries (exactly 3d/7d later) reachable."""
        self.clock.advance(hours * HOUR + seconds)
        note(f"clock +{hours}h{seconds:+d}s -> {self.clock()}")

    @rule(
        tenant=st.sampled_from(TENANTS),
        units=st.none() | st.integers(1, 7),
        retention=st.none() | st.tuples(st.sampled_from(KINDS), st.sampled_from([12, 48, 120])),
    )
    def update(self, tenant: str, units: int | None, retention: tuple[str, int] | None) -> None:
        now = self.tick()
        model = self.tenants[tenant]
        quota = None if units is None else self.regime.quota(units + self.regime.update_offset)
        others = sum(t.quota for name, t in self.tenants.items() if name != tenant)
        capacity = self.regime.quota(self.regime.capacity)
        expected = "QuotaExceededError" if quota is not None and others + quota > capacity else None
        given = None if retention is None else {retention[0]: f"{retention[1]}h"}
        got = call(lambda: self.kv.update_tenant(tenant, quota_bytes=quota, retention=given))
        note(f"update {tenant} quota={quota} retention={given} -> {got} (model {expected})")
        if expected is not None:
            assert got == expected
            return
        assert isinstance(got, tenantkv.TenantInfo), got
        if retention is not None:
            kind, hours = retention
            model.retention[kind] = hours * HOUR
            for extent in self.extents_of(tenant):
                if extent.kind == kind:
                    extent.expires = extent.last_used + hours * HOUR
        if quota is not None:
            model.quota = quota
            self.make_room(tenant, quota, now)
        assert got.quota_bytes == model.quota
        assert got.used_bytes == sum(e.size for e in self.extents_of(tenant))
        assert dict(got.retention or {}) == model.retention

    @rule(tenant=st.sampled_from(TENANTS))
    def rotate(self, tenant: str) -> None:
        self.tick()
        model = self.tenants[tenant]
        version = self.kv.rotate_keys(tenant)
        note(f"rotate {tenant} -> v{version}")
        model.key_version += 1
        model.key_versions.add(model.key_version)
        assert version == model.key_version

    @rule(tenant=st.sampled_from(TENANTS))
    def retire(self, tenant: str) -> None:
        self.tick()
        model = self.tenants[tenant]
        old = [e for e in self.extents_of(tenant) if e.key_version < model.key_version]
        outcome = self.kv.retire_keys(tenant)
        note(f"retire {tenant} -> {outcome}")
        assert outcome == {
            "resealed": len(old),
            "dropped": 0,
            "skipped_in_use": 0,
            "retired_versions": sorted(model.key_versions - {model.key_version}),
            "extents_on_old_keys": 0,
            "scrub_complete": True,  # no other connection reads meanwhile
        }
        for extent in old:
            # Re-sealing keeps the blocks the index still points to (blocks re-stored after the
            # extent expired moved elsewhere); an extent left with none is dropped.
            referenced = {
                k: v
                for k, v in extent.data.items()
                if self.index[extent.space].get(k) == extent.ident
            }
            if not referenced:
                event("retire drops an extent with no referenced block")
                self.remove(extent, metered=False)
                continue
            if len(referenced) < len(extent.data):
                event("retire shrinks an extent")
            extent.data = referenced
            extent.size = extent_bytes(len(referenced))
            extent.key_version = model.key_version
        model.key_versions = {model.key_version}

    @rule(tenant=st.sampled_from(TENANTS))
    def recreate(self, tenant: str) -> None:
        """Crypto-shred a tenant, then create one of the same name: it starts empty."""
        self.tick()
        quota = self.tenants[tenant].quota
        stale = [(i, self.handles[i]) for i, space in enumerate(SPACES) if space.tenant == tenant]
        self.kv.delete_tenant(tenant)
        for extent in self.extents_of(tenant):
            self.remove(extent, metered=False)
        with pytest.raises(tenantkv.TenantNotFoundError):
            self.kv.get_tenant(tenant)
        with pytest.raises(tenantkv.TenantNotFoundError):
            self.kv.usage(tenant)
        self.kv.create_tenant(tenant, quota_bytes=quota, retention=RETENTION)
        self.tenants[tenant] = TenantModel(quota)
        note(f"recreate {tenant} (quota {quota})")
        seq: Seq = ((0,), 0)
        tokens = tokens_of(seq)
        for i, handle in stale:
            self.handles[i] = self.open_space(SPACES[i])
            # A handle of the deleted tenant neither reads nor writes anything any more, and what
            # it meters goes nowhere (not to the new tenant of the same name).
            assert handle.lookup(tokens) == 0
            with pytest.raises(tenantkv.CacheMissError):
                handle.load(tokens)
            with pytest.raises(tenantkv.TenantNotFoundError):
                handle.store(tokens, random_layers(LAYOUT, len(tokens)))

    @rule()
    def gc(self) -> None:
        self.tick()
        self.collect()

    @rule(entry=stored)
    def isolation(self, entry: tuple[int, Seq]) -> None:
        """What one namespace stored is cached for it (positive control: the owner hits, unless
        the model says it was evicted or expired) and for no other namespace (each sees only
        what it stored itself)."""
        self.tick()
        owner, seq = entry
        keys = keys_of(seq)
        owner_hit = self.lookup_checked(owner, seq)
        if keys and self.cached_count(owner, keys, self.clock()) == len(keys):
            assert owner_hit == len(keys) * BLOCK_TOKENS  # positive control
        for other in range(len(SPACES)):
            if other == owner:
                continue
            got = self.lookup_checked(other, seq)
            if keys and got < len(keys) * BLOCK_TOKENS:
                with pytest.raises(tenantkv.CacheMissError):
                    self.handles[other].load(tokens_of(seq)[: len(keys) * BLOCK_TOKENS])

    # ---- invariants -----------------------------------------------------------------------------

    @invariant()
    def accounting(self) -> None:
        for name, model in self.tenants.items():
            info = self.kv.get_tenant(name)
            mine = self.extents_of(name)
            assert info.used_bytes == sum(e.size for e in mine), f"{name} used_bytes"
            assert info.quota_bytes == model.quota
            assert info.used_bytes <= info.quota_bytes, f"{name} over its quota"
            assert info.key_version == model.key_version
            assert info.key_versions == tuple(sorted(model.key_versions))
            total: Counter[str] = Counter()
            for scope in {s.meter_scope for s in SPACES if s.tenant == name}:
                want = {f: model.usage.get(scope, Counter())[f] for f in FIELDS}
                report = self.kv.usage(name, scope=scope)
                assert report.counters == want, f"usage of {name} scope {scope!r}"
                total.update(want)
            report = self.kv.usage(name)
            assert report.counters == {f: total[f] for f in FIELDS}, f"usage of {name}"
            assert report.cost_units == pytest.approx(
                total["miss_tokens"] + self.kv.config.hit_cost * total["served_tokens"]
            )
        for i, handle in enumerate(self.handles):
            want_positions = sorted(len(key) - 1 for key in self.index[i])
            assert sorted(handle.cached_blocks()) == want_positions, f"blocks of ns{i}"
        files = list(self.kv.context.blocks.list())
        assert len(files) == len(self.extents), "extent files on disk vs extents in the model"


# 15 runs of 30 steps each (5 on PostgreSQL): each step checks every tenant's usage report,
# which makes a run cost about 2 s on 2 cores; the suite's time budget buys this many.
MACHINE_SETTINGS = settings(
    max_examples=15,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def machine_settings(index: Index) -> settings:
    return settings(MACHINE_SETTINGS, max_examples=index.examples(MACHINE_SETTINGS.max_examples))


class RoomyMachine(TenantMachine):
    regime = ROOMY


class TightMachine(TenantMachine):
    regime = TIGHT


def test_tenants_against_model_without_eviction(index: Index) -> None:
    """Quotas far above what can be stored: stores, expiry, keys, deletion, GC, metering."""
    run_state_machine_as_test(RoomyMachine, settings=machine_settings(index))


def test_tenants_against_model_with_eviction(index: Index) -> None:
    """Quotas of a few extents: the same machine with quota eviction on most runs."""
    run_state_machine_as_test(TightMachine, settings=machine_settings(index))


# ---- controls and targeted checks ---------------------------------------------------------------


@pytest.mark.usefixtures("index")
@settings(max_examples=1, deadline=None, database=None)
@given(st.none())
def test_machine_has_power(_: None) -> None:
    """Positive controls for the machine itself: the owner hits, others miss, and a model that
    disagrees with the cache is caught."""
    machine = RoomyMachine()
    try:
        seq: Seq = ((0, 1), 1)
        machine.store(0, seq, "chat")
        assert machine.lookup_checked(0, seq) == 2 * BLOCK_TOKENS  # the owner hits
        for other in (1, 2, 3):  # same tenant other scope, other tenants: nothing
            assert machine.lookup_checked(other, seq) == 0
        machine.isolation((0, seq))
        machine.load(0, seq)
        machine.accounting()
        del machine.index[0][(0, 1)]  # a model that forgot a block ...
        with pytest.raises(AssertionError):
            machine.lookup_checked(0, seq)  # ... disagrees with the cache
    finally:
        machine.teardown()


def make_cache(root: str, clock: ManualClock, capacity: int) -> TenantKV:
    return tenantkv.open(root, durable=False, workers=2, capacity_bytes=capacity, clock=clock)


@pytest.mark.usefixtures("index")
def test_quota_eviction_completes(tmp_path: Any) -> None:
    """A store over the quota evicts the least recently used extent, meters it, removes its file
    and returns normally. (Regression: eviction used to raise TypeError in
    TenantKV._scopes_of.)"""
    clock = ManualClock(START)
    with make_cache(str(tmp_path), clock, 10 * extent_bytes(1)) as kv:
        kv.create_tenant("t", quota_bytes=2 * extent_bytes(1), retention=RETENTION)
        ns = kv.namespace("t", model=MODEL_NAME, layout=LAYOUT)
        seqs = [random_tokens(BLOCK_TOKENS, seed=10 + i) for i in range(3)]
        for tokens in seqs:
            clock.advance(1)
            assert ns.store(tokens, random_layers(LAYOUT, BLOCK_TOKENS)) == BLOCK_TOKENS
        assert [ns.lookup(tokens) for tokens in seqs] == [0, BLOCK_TOKENS, BLOCK_TOKENS]
        usage = kv.usage("t").counters
        assert (usage["evicted_extents"], usage["evicted_bytes"]) == (1, extent_bytes(1))
        assert len(list(kv.context.blocks.list())) == 2


@pytest.mark.usefixtures("index")
def test_restore_of_expired_prefix_before_gc(tmp_path: Any) -> None:
    """An expired prefix is a miss at once, and storing it again caches it again, before GC."""
    clock = ManualClock(START)
    with make_cache(str(tmp_path), clock, 2**26) as kv:
        kv.create_tenant("t", quota_bytes=2**24, retention=RETENTION)
        ns = kv.namespace("t", model=MODEL_NAME, layout=LAYOUT)
        tokens = tokens_of(((0, 1), 0))
        assert ns.store(tokens, random_layers(LAYOUT, len(tokens)), kind="agent") == len(tokens)
        clock.advance(3 * DAY)
        assert ns.lookup(tokens) == 0  # expired = miss (this part holds)
        clock.advance(1)
        stored = ns.store(tokens, random_layers(LAYOUT, len(tokens), seed=1), kind="agent")
        assert (stored, ns.lookup(tokens)) == (len(tokens), len(tokens))


@pytest.mark.usefixtures("index")
def test_gc_does_not_warn_about_extents_it_collected(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """GC removes an expired extent quietly. (Regression: its orphan sweep used to look up the
    files it had just deleted and log 'orphan sweep could not remove ...' for each.)"""
    clock = ManualClock(START)
    with make_cache(str(tmp_path), clock, 2**26) as kv:
        kv.create_tenant("t", quota_bytes=2**24, retention=RETENTION)
        ns = kv.namespace("t", model=MODEL_NAME, layout=LAYOUT)
        tokens = tokens_of(((0,), 0))
        ns.store(tokens, random_layers(LAYOUT, len(tokens)), kind="agent")
        clock.advance(4 * DAY)
        with caplog.at_level(logging.WARNING, logger="tenantkv"):
            report = kv.gc(orphan_grace=0)
        assert report.expired_extents == 1
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
