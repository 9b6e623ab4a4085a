"""Lookups answered from the keys a node holds (``tenantkv.components.lookup_cache``) agree with
the index.

Every lookup here is checked against the index itself (``index_answer``: the keys present with
an unexpired extent, asked of the index the way every lookup used to), after stores, evictions,
expiry, retention changes, GC, purges, tenant deletion (crypto-shredding) and lost extents, made
by the same node, by a second ``TenantKV`` on the same index, or by another process. The
stateful test drives two nodes sharing one index and one clock against that oracle, with a
positive control after every store (both nodes hit what was just stored).
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import event

import tenantkv
from tenantkv import CacheMissError, Namespace, TenantKV, prefix
from tenantkv.components.lookup_cache import HeldKeys, LookupCache
from tenantkv.crypto import KeyEncryptionKey
from tenantkv.index import blocks, counters, removals
from tenantkv.prefix import model_fingerprint
from tests.helpers import (
    MLA_SMALL,
    ManualClock,
    layers_equal,
    load_all,
    random_layers,
    random_tokens,
)
from tests.indexes import Index
from tests.test_fleet_coordination import nodes
from tests.test_tenants import BIG_QUOTA, extent_path, open_cache

DAY = 86400.0
MODEL = "lookup-model"
_names = itertools.count()


def fresh_name(stem: str) -> str:
    return f"{stem}-{next(_names)}"


def index_answer(kv: TenantKV, ns: Namespace, tokens: Sequence[int]) -> int:
    """What the index says: the longest run of ``tokens``' blocks present from the first,
    asked of the index for every key (the lookup of before the node-local structure)."""
    keys = ns._keys(tokens)
    with kv.context.index.read() as session:
        present = blocks.present_keys(
            session, ns.identity.namespace_id, keys, kv.context.clock(), stop_at_gap=False
        )
    run = 0
    for key in keys:
        if key not in present:
            break
        run += 1
    return run * ns.block_tokens


def held_keys(kv: TenantKV, ns: Namespace) -> HeldKeys | None:
    return kv.context.lookups.held(ns.identity.namespace_id)


# ---- prefix keys stay what they were -----------------------------------------------------------


@pytest.mark.parametrize(
    "block_keys",
    [prefix.block_keys, prefix.block_keys_python],
    ids=["as-installed", "hashlib"],
)
def test_block_keys_are_the_documented_chain_and_unchanged(
    block_keys: Callable[..., list[bytes]],
) -> None:
    """Pinned vectors (computed before the hashing loop was optimised) and an independent
    computation from the formula in ``tenantkv.prefix``, for the C chain this install built and
    for the hashlib loop: caches already on disk, and edited prefixes chained from them, keep
    their keys."""
    key = hashlib.sha256(b"namespace key").digest()
    fingerprint = model_fingerprint("vector-model", "r1", {"kind": "mla"})
    assert fingerprint.hex() == "273aee251a4c48381a390945a1714dd8ee979907f96198e9f47b4a6a9306536c"
    tokens = (np.arange(200, dtype=np.uint64) * 7919 % 50000).astype(np.uint32)
    pinned = {
        64: (
            3,
            "e4e722babf920ba5b038c15b4da684773ce55ce623ee9942751f837b44db6e03",
            "f197158c1f8e709e0dc57ba43ac24dd384fd9f9485cc8df4da523850a870124e",
        ),
        16: (
            12,
            "562ccfe545e1b4ebaf2322fd427442beba92610c8d78e71b29cfb0f0d043ac01",
            "f56ee2574b673ea01d88cf9470d11a4d53e715df178b1e4b3a0945be78eb1088",
        ),
    }
    for block_tokens, (count, first, last) in pinned.items():
        keys = block_keys(key, fingerprint, tokens, block_tokens)
        assert (len(keys), keys[0].hex(), keys[-1].hex()) == (count, first, last)
    for block_tokens in (16, 64, 128):
        previous: bytes = fingerprint
        expected = []
        for start in range(0, len(tokens) // block_tokens * block_tokens, block_tokens):
            digest = hashlib.blake2b(previous, key=key, digest_size=32, person=b"tenantkv-pfx-v1")
            digest.update(tokens[start : start + block_tokens].astype("<u4").tobytes())
            previous = digest.digest()
            expected.append(previous)
        assert block_keys(key, fingerprint, tokens, block_tokens) == expected
    assert block_keys(key, fingerprint, tokens[:63]) == []


# ---- the structure alone -----------------------------------------------------------------------


def _keys(count: int) -> dict[bytes, float]:
    return {secrets.token_bytes(32): 100.0 for _ in range(count)}


def test_held_keys_answer_a_run_up_to_the_first_missing_or_expired_key() -> None:
    found = _keys(4)
    keys = list(found)
    held = HeldKeys(0, dict(found))
    assert held.run(keys, now=50.0) == 4
    assert held.run(keys, now=100.0) == 0  # expiry times are exclusive, as in the index
    assert held.run([*keys[:2], secrets.token_bytes(32), keys[3]], now=50.0) == 2
    held.expires[keys[1]] = 40.0
    assert held.run(keys, now=50.0) == 1
    assert held.run([], now=50.0) == 0


def test_the_structure_keeps_namespaces_apart_and_its_bound() -> None:
    cache = LookupCache(max_keys=10)
    a, b, c = (secrets.token_bytes(16) for _ in range(3))
    found_a, found_b = _keys(4), _keys(4)
    cache.add(a, 0, found_a)
    cache.add(b, 0, found_b)
    held_a, held_b = cache.held(a), cache.held(b)
    assert held_a is not None and held_b is not None
    assert held_a.run(list(found_a), 0.0) == 4 and held_b.run(list(found_a), 0.0) == 0
    assert cache.size() == (2, 8)
    cache.add(c, 0, _keys(4))  # over the bound: a, the least recently used, goes whole
    assert cache.held(a) is None and cache.held(b) is not None and cache.held(c) is not None
    assert cache.size() == (2, 8)
    cache.held(b)  # b is now the most recent: c goes next
    cache.add(a, 0, _keys(3))
    assert cache.held(c) is None and cache.size() == (2, 7)
    big = _keys(8)
    cache.add(b, 0, big)  # b alone is over the bound: it keeps only what was just found
    held = cache.held(b)
    assert held is not None and set(held.expires) == set(big)
    assert cache.size()[1] <= 10
    cache.add(b, 0, _keys(11))  # more than the bound at once: nothing is kept for it
    assert cache.held(b) is None and cache.size()[1] <= 10


def test_the_structure_drops_keys_read_under_another_removal_count() -> None:
    cache = LookupCache(max_keys=100)
    namespace = secrets.token_bytes(16)
    first, second = _keys(3), _keys(3)
    cache.add(namespace, 1, first)
    cache.add(namespace, 2, second)  # a removal happened: the keys of count 1 are dropped
    held = cache.held(namespace)
    assert held is not None and held.removals == 2 and set(held.expires) == set(second)
    cache.add(namespace, 1, first)  # read before that removal: not added
    held = cache.held(namespace)
    assert held is not None and set(held.expires) == set(second)
    assert cache.size() == (1, 3)
    cache.forget(namespace)
    assert cache.held(namespace) is None and cache.size() == (0, 0)
    off = LookupCache(max_keys=0)
    off.add(namespace, 0, first)
    assert off.held(namespace) is None


# ---- one node, then two ------------------------------------------------------------------------


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(float(int(time.time()) // 60 * 60))


@contextmanager
def two_nodes(
    root: Path, clock: ManualClock, **options: Any
) -> Iterator[tuple[TenantKV, TenantKV]]:
    """Two caches on one root (one index, one extent directory, one master key, one clock),
    as two inference nodes of a fleet."""
    master_key = secrets.token_bytes(32)
    first = open_cache(root, clock, master_key, **options)
    try:
        second = tenantkv.open(
            root, durable=False, clock=clock, master_key=KeyEncryptionKey(master_key), **options
        )
        try:
            yield first, second
        finally:
            second.close()
    finally:
        first.close()


def _statements(kv: TenantKV) -> tuple[list[str], Any]:
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append(statement)

    # Serving calls go through their own engine on PostgreSQL (a shorter bound): watch both.
    index = kv.context.index
    engines = {id(engine): engine for engine in (index.engine, index.serving_engine)}.values()
    for engine in engines:
        event.listen(engine, "before_cursor_execute", record)

    def stop() -> None:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", record)

    return seen, stop


@pytest.mark.usefixtures("index")
def test_a_warm_lookup_asks_the_index_one_statement(tmp_path: Path, clock: ManualClock) -> None:
    with two_nodes(tmp_path / "cache", clock) as (kv, _other):
        kv.create_tenant("acme", quota_bytes=BIG_QUOTA)
        ns = kv.namespace("acme", model=MODEL, layout=MLA_SMALL)
        tokens = random_tokens(64 * 20, seed=1)
        assert ns.store(tokens, random_layers(MLA_SMALL, len(tokens), seed=1)) == len(tokens)
        assert ns.lookup(tokens) == len(tokens)  # cold: asks the index, holds what it found
        held = held_keys(kv, ns)
        assert held is not None and len(held.expires) == 20
        seen, stop = _statements(kv)
        try:
            assert ns.lookup(tokens) == len(tokens)
            assert ns.lookup(tokens[: 64 * 7 + 5]) == 64 * 7
            assert ns.cached_length(tokens + random_tokens(200, seed=2)) == len(tokens)
            assert ns.lookup(random_tokens(64 * 20, seed=3)) == 0  # a miss: one statement too
        finally:
            stop()
        assert len(seen) == 4, seen
        # positive control: the statement counter sees the chunked queries of a cold lookup
        kv.context.lookups.clear()
        seen, stop = _statements(kv)
        try:
            assert ns.lookup(tokens) == len(tokens)
        finally:
            stop()
        assert len(seen) == 2, seen


REMOVALS = ["purge", "evict", "retention", "expiry", "gc", "lost", "delete_tenant"]


@pytest.mark.parametrize("removal", REMOVALS)
@pytest.mark.usefixtures("index")
def test_a_removal_on_another_node_is_a_miss_at_once(
    tmp_path: Path, clock: ManualClock, removal: str
) -> None:
    """Node one holds a prefix's keys; node two removes (some of) its blocks; node one's next
    lookup answers what the index says, and a load of the old answer is a miss, never data."""
    root = tmp_path / "cache"
    with two_nodes(root, clock) as (one, two):
        one.create_tenant("acme", quota_bytes=BIG_QUOTA, retention={"chat": "7d"})
        ns_one = one.namespace("acme", model=MODEL, layout=MLA_SMALL)
        ns_two = two.namespace("acme", model=MODEL, layout=MLA_SMALL)
        head, tail = random_tokens(64 * 3, seed=10), random_tokens(64 * 2, seed=11)
        layers = random_layers(MLA_SMALL, len(head) + len(tail), seed=10)
        # two extents: the first 3 blocks (used first, so evicted first), then 2 more
        assert ns_one.store(head, [layer[: len(head)] for layer in layers]) == len(head)
        clock.advance(60)
        assert ns_one.store(head + tail, layers) == len(tail)
        full = head + tail
        assert ns_one.lookup(full) == len(full) == ns_two.lookup(full)  # positive control
        assert layers_equal(load_all(ns_one, full)[0], layers[0])
        held = held_keys(one, ns_one)
        assert held is not None and len(held.expires) == 5
        if removal == "purge":
            two.purge("acme")
        elif removal == "evict":
            # to half the bytes: whichever extent goes first, the other does not fit alone
            # unless it is the newer one of 2 blocks; either way block 0 is gone
            two.update_tenant("acme", quota_bytes=_extent_bytes(two, ns_two) // 2)
            two.update_tenant("acme", quota_bytes=BIG_QUOTA)
        elif removal == "retention":
            clock.advance(2 * DAY)
            two.update_tenant("acme", retention={"chat": "1d"})  # both extents now expired
        elif removal == "expiry":
            clock.advance(7 * DAY + 1)
        elif removal == "gc":
            clock.advance(7 * DAY + 1)
            two.gc()
        elif removal == "lost":
            extent_path(root, _extent_of_block_0(two, ns_two)).unlink()
            with pytest.raises(CacheMissError):
                ns_two.load(full)  # the load finds the extent lost: the index drops it
        elif removal == "delete_tenant":
            two.delete_tenant("acme")
        got = ns_one.lookup(full)
        assert got == index_answer(one, ns_one, full) == 0
        assert ns_one.cached_length(full) == 0
        with pytest.raises(CacheMissError):
            ns_one.load(full)  # what the held keys said before: a miss now, never data
        # and what is there again afterwards is a hit on both nodes at once
        if removal == "delete_tenant":
            two.create_tenant("acme", quota_bytes=BIG_QUOTA)
            ns_one = one.namespace("acme", model=MODEL, layout=MLA_SMALL)
            ns_two = two.namespace("acme", model=MODEL, layout=MLA_SMALL)
        if removal == "retention":  # a longer retention brings the extents back
            two.update_tenant("acme", retention={"chat": "7d"})
        else:
            restored = ns_two.store(full, layers)
            if removal == "lost":  # only the extent of block 0 went
                assert restored == len(head)
            elif removal == "evict":  # that one went; the other may have fit the quota
                assert restored in (len(head), len(full))
            else:
                assert restored == len(full)
        assert ns_one.lookup(full) == len(full) == ns_two.lookup(full)
        assert layers_equal(load_all(ns_one, full)[-1], layers[-1])


def _extent_of_block_0(kv: TenantKV, ns: Namespace) -> str:
    from sqlalchemy import select

    from tenantkv.index.schema import Block

    with kv.context.index.read() as session:
        found = session.scalar(
            select(Block.extent_id).where(
                Block.namespace_id == ns.identity.namespace_id, Block.position == 0
            )
        )
    assert found is not None
    return str(found)


def _extent_ids(kv: TenantKV, ns: Namespace) -> list[str]:
    from sqlalchemy import select

    from tenantkv.index.schema import Extent

    with kv.context.index.read() as session:
        return list(
            session.scalars(
                select(Extent.id)
                .where(Extent.namespace_id == ns.identity.namespace_id)
                .order_by(Extent.last_used_at)
            ).all()
        )


def _extent_bytes(kv: TenantKV, ns: Namespace) -> int:
    from sqlalchemy import func, select

    from tenantkv.index.schema import Extent

    with kv.context.index.read() as session:
        return int(
            session.scalar(
                select(func.sum(Extent.size_bytes)).where(
                    Extent.namespace_id == ns.identity.namespace_id
                )
            )
            or 0
        )


@pytest.mark.usefixtures("index")
def test_blocks_stored_by_another_node_are_hits_at_once(tmp_path: Path, clock: ManualClock) -> None:
    with two_nodes(tmp_path / "cache", clock) as (one, two):
        one.create_tenant("acme", quota_bytes=BIG_QUOTA)
        ns_one = one.namespace("acme", model=MODEL, layout=MLA_SMALL)
        ns_two = two.namespace("acme", model=MODEL, layout=MLA_SMALL)
        tokens = random_tokens(64 * 6, seed=20)
        layers = random_layers(MLA_SMALL, len(tokens), seed=20)
        assert ns_one.store(tokens[:128], [layer[:128] for layer in layers]) == 128
        assert ns_one.lookup(tokens) == 128  # holds 2 blocks
        assert ns_two.store(tokens, layers) == 64 * 4  # the other node adds 4
        assert ns_one.lookup(tokens) == len(tokens)
        assert ns_one.lookup(tokens) == len(tokens)
        held = held_keys(one, ns_one)
        assert held is not None and len(held.expires) == 6


@pytest.mark.usefixtures("index")
def test_namespaces_and_scopes_never_see_each_others_held_keys(
    tmp_path: Path, clock: ManualClock
) -> None:
    with two_nodes(tmp_path / "cache", clock) as (kv, _other):
        kv.create_tenant("alpha", quota_bytes=BIG_QUOTA)
        kv.create_tenant("beta", quota_bytes=BIG_QUOTA)
        owner = kv.namespace("alpha", model=MODEL, layout=MLA_SMALL)
        others = [
            kv.namespace("beta", model=MODEL, layout=MLA_SMALL),
            kv.namespace("alpha", model=MODEL, layout=MLA_SMALL, scope="user-2"),
            kv.namespace("alpha", model="other-model", layout=MLA_SMALL),
        ]
        tokens = random_tokens(64 * 4, seed=30)
        assert owner.store(tokens, random_layers(MLA_SMALL, len(tokens), seed=30)) == len(tokens)
        for _ in range(2):
            assert owner.lookup(tokens) == len(tokens)  # positive control
            for ns in others:
                assert ns.lookup(tokens) == 0
        held = held_keys(kv, owner)
        assert held is not None and len(held.expires) == 4
        for ns in others:
            other_held = held_keys(kv, ns)
            assert other_held is None or not other_held.expires


@pytest.mark.usefixtures("index")
def test_removals_are_counted_per_namespace(tmp_path: Path, clock: ManualClock) -> None:
    with two_nodes(tmp_path / "cache", clock) as (kv, _other):
        kv.create_tenant("alpha", quota_bytes=BIG_QUOTA)
        kv.create_tenant("beta", quota_bytes=BIG_QUOTA)
        a = kv.namespace("alpha", model=MODEL, layout=MLA_SMALL)
        b = kv.namespace("beta", model=MODEL, layout=MLA_SMALL)
        tokens = random_tokens(64 * 2, seed=40)
        for ns in (a, b):
            ns.store(tokens, random_layers(MLA_SMALL, len(tokens), seed=40))

        def count(ns: Namespace) -> int:
            with kv.context.index.read() as session:
                return counters.read(session, removals.counter_name(ns.identity.namespace_id))

        assert (count(a), count(b)) == (0, 0)
        kv.purge("alpha")
        assert (count(a), count(b)) == (1, 0)
        kv.delete_tenant("alpha")
        assert count(a) == 0 and count(b) == 0  # deleted with its namespace


@pytest.mark.usefixtures("index")
def test_a_cache_with_the_structure_off_answers_the_same(
    tmp_path: Path, clock: ManualClock
) -> None:
    with two_nodes(tmp_path / "cache", clock, lookup_cache_keys=0) as (one, two):
        one.create_tenant("acme", quota_bytes=BIG_QUOTA)
        ns_one = one.namespace("acme", model=MODEL, layout=MLA_SMALL)
        ns_two = two.namespace("acme", model=MODEL, layout=MLA_SMALL)
        tokens = random_tokens(64 * 3, seed=50)
        assert ns_one.store(tokens, random_layers(MLA_SMALL, len(tokens), seed=50)) == len(tokens)
        assert ns_one.lookup(tokens) == ns_two.lookup(tokens) == len(tokens)
        assert one.context.lookups.size() == (0, 0)
        two.purge("acme")
        assert ns_one.lookup(tokens) == 0


def test_another_process_removing_and_adding_blocks_is_seen_at_once(
    tmp_path: Path, index: Index
) -> None:
    """A node process (``tests/fleet_node.py``) holds a prefix's keys from its lookups; this
    process purges, stores again and deletes the tenant, and the node's lookups follow."""
    root = tmp_path / "cache"
    tokens = random_tokens(128, seed=60)
    layers = random_layers(MLA_SMALL, 128, seed=60)
    with tenantkv.open(root, durable=False) as admin:
        admin.create_tenant("acme", quota_bytes=BIG_QUOTA)
        ns = admin.namespace("acme", model="fleet-model", layout=MLA_SMALL)
        with nodes(root, index.url(root), 1) as (node,):
            assert node.ask(op="lookup", seed=60) == {"hit": 0}
            assert node.ask(op="store", seeds=[60]) == {"stored": [128]}
            assert node.ask(op="lookup", seed=60) == {"hit": 128}  # held now
            assert node.ask(op="lookup", seed=60) == {"hit": 128}
            admin.purge("acme")
            assert node.ask(op="lookup", seed=60) == {"hit": 0}
            assert node.ask(op="load", seed=60) == {"error": "CacheMissError"}
            assert ns.store(tokens, layers) == 128
            assert node.ask(op="lookup", seed=60) == {"hit": 128}
            assert node.ask(op="load", seed=60) == {"exact": [True] * MLA_SMALL.num_layers}
            admin.delete_tenant("acme")
            assert node.ask(op="lookup", seed=60) == {"hit": 0}
            assert node.ask(op="events")["security_events"] == {}


# ---- stateful: two nodes, one index, against the index ------------------------------------------

BASES = 3
BASE_BLOCKS = 6
MACHINE_QUOTA = 2**21  # ample for 3 prefixes of 6 blocks, and 500 tenants fit the capacity


class LookupMachine(RuleBasedStateMachine):
    """Two nodes and three namespaces (two tenants, one with two scopes) sharing one index and
    one fake clock; every lookup on either node is compared with the index."""

    def __init__(self, nodes: tuple[TenantKV, TenantKV], clock: ManualClock) -> None:
        super().__init__()
        self.nodes = nodes
        self.clock = clock
        self.tenants: list[str] = []
        self.spaces: list[tuple[int, str | None]] = [(0, None), (1, "one"), (1, "two")]
        self.namespaces: list[list[Namespace]] = []
        salt = next(_names) * 1000
        self.bases = [random_tokens(64 * BASE_BLOCKS + 30, seed=salt + i) for i in range(BASES)]
        self.seeds = itertools.count(salt + 100)

    @initialize()
    def open_tenants(self) -> None:
        self.tenants = [fresh_name("alpha"), fresh_name("beta")]
        for name in self.tenants:
            self.nodes[0].create_tenant(name, quota_bytes=MACHINE_QUOTA)
        self.reopen()

    def teardown(self) -> None:
        for name in self.tenants:  # frees the capacity for the next example
            self.nodes[0].delete_tenant(name)

    def reopen(self) -> None:
        self.namespaces = [
            [
                kv.namespace(self.tenants[tenant], model=MODEL, layout=MLA_SMALL, scope=scope)
                for tenant, scope in self.spaces
            ]
            for kv in self.nodes
        ]

    def tokens(self, base: int, length: int) -> list[int]:
        return self.bases[base][:length]

    def check(self, space: int, tokens: list[int]) -> int:
        answers = []
        for node, kv in enumerate(self.nodes):
            ns = self.namespaces[node][space]
            got = ns.lookup(tokens) if node == 0 else ns.cached_length(tokens)
            truth = index_answer(kv, ns, tokens)
            note(f"lookup node{node} ns{space} len={len(tokens)} -> {got} (index {truth})")
            assert got == truth
            answers.append(got)
        assert answers[0] == answers[1]
        return answers[0]

    @rule(
        node=st.integers(0, 1),
        space=st.integers(0, 2),
        base=st.integers(0, BASES - 1),
        length=st.integers(0, 64 * BASE_BLOCKS + 30),
    )
    def store(self, node: int, space: int, base: int, length: int) -> None:
        tokens = self.tokens(base, length)
        layers = random_layers(MLA_SMALL, len(tokens), seed=next(self.seeds))
        stored = self.namespaces[node][space].store(tokens, layers)
        note(f"store node{node} ns{space} base{base} len={length} -> {stored}")
        full = len(tokens) // 64 * 64
        assert self.check(space, tokens) == full  # positive control: both nodes hit it

    @rule(
        space=st.integers(0, 2),
        base=st.integers(0, BASES - 1),
        length=st.integers(0, 64 * BASE_BLOCKS + 30),
    )
    def lookup(self, space: int, base: int, length: int) -> None:
        self.check(space, self.tokens(base, length))

    @rule(seconds=st.sampled_from([60.0, DAY, 3 * DAY + 1, 7 * DAY + 1]))
    def advance_clock(self, seconds: float) -> None:
        note(f"clock +{seconds}")
        self.clock.advance(seconds)

    @rule(node=st.integers(0, 1), tenant=st.integers(0, 1), scoped=st.booleans())
    def purge(self, node: int, tenant: int, scoped: bool) -> None:
        scope = "one" if scoped and tenant == 1 else None
        note(f"purge node{node} tenant{tenant} scope={scope}")
        self.nodes[node].purge(self.tenants[tenant], scope=scope)

    @rule(node=st.integers(0, 1), tenant=st.integers(0, 1), keep=st.integers(0, 200_000))
    def evict(self, node: int, tenant: int, keep: int) -> None:
        note(f"evict node{node} tenant{tenant} down to {keep} B")
        kv = self.nodes[node]
        kv.update_tenant(self.tenants[tenant], quota_bytes=max(keep, 1))
        kv.update_tenant(self.tenants[tenant], quota_bytes=MACHINE_QUOTA)

    @rule(node=st.integers(0, 1), tenant=st.integers(0, 1), days=st.sampled_from([1, 3, 7]))
    def set_retention(self, node: int, tenant: int, days: int) -> None:
        note(f"retention node{node} tenant{tenant} chat={days}d")
        self.nodes[node].update_tenant(self.tenants[tenant], retention={"chat": f"{days}d"})

    @rule(node=st.integers(0, 1))
    def gc(self, node: int) -> None:
        note(f"gc node{node}")
        self.nodes[node].gc()

    @rule(node=st.integers(0, 1), tenant=st.integers(0, 1), base=st.integers(0, BASES - 1))
    def delete_tenant(self, node: int, tenant: int, base: int) -> None:
        name = self.tenants[tenant]
        note(f"delete node{node} tenant{tenant}")
        self.nodes[node].delete_tenant(name)
        tokens = self.tokens(base, 64 * BASE_BLOCKS)
        for spaces in self.namespaces:  # namespaces of a deleted tenant: every lookup misses
            for space, (owner, _scope) in enumerate(self.spaces):
                if owner == tenant:
                    assert spaces[space].lookup(tokens) == 0
        self.tenants[tenant] = fresh_name(name.split("-")[0])
        self.nodes[1 - node].create_tenant(self.tenants[tenant], quota_bytes=MACHINE_QUOTA)
        self.reopen()

    @invariant()
    def held_keys_are_in_the_index_while_trusted(self) -> None:
        """Whatever a node would trust (held under the current removal count, unexpired) is
        present in the index."""
        if not self.namespaces:
            return
        now = self.clock()
        for node, kv in enumerate(self.nodes):
            for ns in self.namespaces[node]:
                held = held_keys(kv, ns)
                if held is None:
                    continue
                namespace_id = ns.identity.namespace_id
                with kv.context.index.read() as session:
                    count = counters.read(session, removals.counter_name(namespace_id))
                    if count != held.removals:
                        continue
                    trusted = [k for k, expires in list(held.expires.items()) if expires > now]
                    present = blocks.present_keys(
                        session, namespace_id, trusted, now, stop_at_gap=False
                    )
                assert set(trusted) <= present


@pytest.mark.usefixtures("index")
def test_two_nodes_against_the_index() -> None:
    clock = ManualClock(float(int(time.time()) // 60 * 60))
    with (
        tempfile.TemporaryDirectory(prefix="tenantkv-lookup-") as root,
        two_nodes(Path(root), clock) as pair,
    ):

        class BoundMachine(LookupMachine):
            def __init__(self) -> None:
                super().__init__(pair, clock)

        run_state_machine_as_test(
            BoundMachine,
            settings=settings(
                max_examples=25,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            ),
        )
