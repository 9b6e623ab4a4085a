"""Non-interference between tenants (DESIGN.md §4.1), as a property.

For a random schedule of tenant A's and tenant B's operations (and operator GC runs), each with
its own clock step, B's full observation trace -- lookup lengths, sha256 digests of loaded layer
bytes, store results and error types, key operations, and after every one of its operations its
usage counters and bytes used -- must be the same whether A did what the schedule says, did
something else entirely, or nothing at all. Every run uses a fresh cache with the same capacity,
the same fixed quotas and the same clock schedule.

Positive controls show the comparison has power: when "A" issues its operations through B's own
namespace (no isolation), the same kind of schedule does change B's trace.
"""

from __future__ import annotations

import hashlib
import itertools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import tenantkv
from tenantkv import BLOCK_TOKENS, Namespace, TenantKV
from tenantkv.components.metering import FIELDS
from tests.indexes import Index

from .helpers import ManualClock, load_all, random_layers, random_tokens
from .test_tenant_model import (
    DAY,
    LAYOUT,
    MODEL_NAME,
    RETENTION,
    SEQUENCES,
    BackgroundWork,
    Seq,
    extent_bytes,
    layer_bytes,
    tokens_of,
)

# Quotas in one-block extents; the capacity is exactly their sum (no slack, no overcommit).
QUOTA_A = 3
QUOTA_B = 4

Op = tuple[Any, ...]
"""("store", seq, kind) | ("lookup", seq) | ("load", seq) | ("rotate",) | ("retire",)
| ("recreate",) | ("flood", count) | ("stale_lookup", seq) | ("idle",)"""


@dataclass(frozen=True)
class Slot:
    """One step of the schedule: the clock moves ``dt`` seconds, then ``actor`` acts.

    B slots carry B's operation; A slots carry A's operation in each variant (the variant with
    A removed makes every A slot idle); "gc" slots run the operator's GC in every variant.
    """

    dt: float
    actor: str  # "A", "B" or "gc"
    op: Op = ("idle",)
    alternative: Op = ("idle",)


Schedule = list[Slot]
Trace = list[tuple[Any, ...]]


# ---- strategies ---------------------------------------------------------------------------------

KINDS = st.sampled_from(["agent", "chat"])
B_OPS: st.SearchStrategy[Op] = st.one_of(
    st.tuples(st.just("store"), SEQUENCES, KINDS),
    st.tuples(st.just("store"), SEQUENCES, KINDS),
    st.tuples(st.just("lookup"), SEQUENCES),
    st.tuples(st.just("load"), SEQUENCES),
    st.tuples(st.sampled_from(["rotate", "retire"])),
)
A_OPS: st.SearchStrategy[Op] = st.one_of(
    B_OPS,
    st.tuples(st.just("flood"), st.integers(2, 6)),
    st.tuples(st.sampled_from(["recreate", "idle"])),
)
DT = st.sampled_from([1.0, 60.0, 3600.0, 6 * 3600.0, DAY, 3 * DAY - 1, 3 * DAY, 4 * DAY])


@st.composite
def schedules(draw: st.DrawFn, max_slots: int = 16) -> Schedule:
    slots: Schedule = []
    for _ in range(draw(st.integers(1, max_slots))):
        dt = draw(DT)
        actor = draw(st.sampled_from(["A", "A", "B", "B", "gc"]))
        if actor == "B":
            slots.append(Slot(dt, "B", draw(B_OPS)))
        elif actor == "A":
            slots.append(Slot(dt, "A", draw(A_OPS), draw(A_OPS)))
        else:
            slots.append(Slot(dt, "gc"))
    return slots


# ---- running a schedule -------------------------------------------------------------------------


def digest(layers: list[tenantkv.Layer]) -> str:
    h = hashlib.sha256()
    for layer in layers:
        h.update(layer_bytes(layer))
    return h.hexdigest()


def outcome(operation: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The result of ``operation(*args, **kwargs)``, or the type name of whatever it raised (an
    observation like any other)."""
    try:
        return operation(*args, **kwargs)
    except Exception as err:
        return type(err).__name__


class Run:
    """One fresh cache with tenants A and B, executing a schedule and recording B's trace."""

    def __init__(self, root: str, *, shared: bool) -> None:
        self.clock = ManualClock()
        unit = extent_bytes(1)
        self.kv: TenantKV = tenantkv.open(
            root,
            durable=False,
            workers=2,
            capacity_bytes=(QUOTA_A + QUOTA_B) * unit,
            clock=self.clock,
        )
        self.background = BackgroundWork(self.kv)
        self.kv.create_tenant("A", quota_bytes=QUOTA_A * unit, retention=RETENTION)
        self.kv.create_tenant("B", quota_bytes=QUOTA_B * unit, retention=RETENTION)
        self.shared = shared
        self.ns_b = self.open("B")
        self.ns_a = self.ns_b if shared else self.open("A")
        self.trace: Trace = []

    def open(self, tenant: str) -> Namespace:
        return self.kv.namespace(tenant, model=MODEL_NAME, layout=LAYOUT)

    def close(self) -> None:
        self.kv.close()

    def lookup_and_load(self, ns: Namespace, tokens: list[int]) -> tuple[int, str]:
        cached = ns.lookup(tokens)
        if not cached:
            return 0, ""
        layers = load_all(ns, tokens[:cached])
        self.background.wait()  # the load's use is recorded before the next operation
        return cached, digest(layers)

    def perform(self, actor: str, op: Op, index: int) -> Any:
        """Run one operation of ``actor`` (slot ``index``); return what it observed."""
        ns = self.ns_b if actor == "B" else self.ns_a
        tenant = "B" if actor == "B" or self.shared else "A"
        name = op[0]
        seed = index if actor == "B" else 100_000 + 10 * index
        if name == "store":
            tokens = tokens_of(op[1])
            layers = random_layers(LAYOUT, len(tokens), seed=seed)
            return outcome(ns.store, tokens, layers, kind=op[2])
        if name == "lookup":
            return outcome(ns.lookup, tokens_of(op[1]))
        if name == "load":
            return outcome(self.lookup_and_load, ns, tokens_of(op[1]))
        if name == "rotate":
            return outcome(self.kv.rotate_keys, tenant)
        if name == "retire":
            return outcome(lambda: sorted(self.kv.retire_keys(tenant).items()))
        if name == "flood":  # many distinct prefixes, together far beyond A's quota
            results = []
            for k in range(op[1]):
                blocks = 1 + (seed + k) % 3
                tokens = random_tokens(blocks * BLOCK_TOKENS, seed=seed * 31 + k)
                layers = random_layers(LAYOUT, len(tokens), seed=seed + k)
                results.append(outcome(ns.store, tokens, layers, kind="chat"))
            return results
        if name in ("recreate", "stale_lookup"):
            assert not self.shared
            stale = self.ns_a
            self.kv.delete_tenant("A")
            self.kv.create_tenant("A", quota_bytes=QUOTA_A * extent_bytes(1), retention=RETENTION)
            self.ns_a = self.open("A")
            if name == "stale_lookup":  # a server still holding a handle of the deleted tenant
                return outcome(stale.lookup, tokens_of(op[1]))
            return None
        assert name == "idle", op
        return None

    def observe_b(self) -> tuple[Any, ...]:
        """B's usage counters and bytes used, now."""
        usage = outcome(lambda: tuple(self.kv.usage("B").counters[f] for f in FIELDS))
        used = outcome(lambda: self.kv.get_tenant("B").used_bytes)
        return ("usage", usage, used)

    def execute(self, schedule: Schedule, variant: str) -> Trace:
        """``variant``: "op" (A does ``slot.op``), "alternative" or "removed" (A idles)."""
        for index, slot in enumerate(schedule):
            self.clock.advance(slot.dt)
            if slot.actor == "gc":
                self.kv.gc(orphan_grace=0)
            elif slot.actor == "A":
                op = {"op": slot.op, "alternative": slot.alternative}.get(variant, ("idle",))
                self.perform("A", op, index)
            else:
                self.trace.append(("B", index, slot.op, self.perform("B", slot.op, index)))
                self.trace.append(self.observe_b())
        self.trace.append(self.observe_b())
        self.trace.append(("blocks", sorted(self.ns_b.cached_blocks())))
        self.trace.append(("keys", outcome(lambda: self.kv.get_tenant("B").key_versions)))
        return self.trace


def trace_of_b(schedule: Schedule, variant: str, *, shared: bool = False) -> Trace:
    with tempfile.TemporaryDirectory(prefix="tenantkv-ni-") as root:
        run = Run(root, shared=shared)
        try:
            return run.execute(schedule, variant)
        finally:
            run.close()


def results(trace: Trace, name: str) -> list[Any]:
    """What B's operations named ``name`` observed, in order."""
    return [entry[3] for entry in trace if entry[0] == "B" and entry[2][0] == name]


def final_usage(trace: Trace) -> dict[str, int]:
    usage = [entry for entry in trace if entry[0] == "usage"][-1][1]
    assert isinstance(usage, tuple), usage
    return dict(zip(FIELDS, usage, strict=True))


def first_difference(a: Trace, b: Trace) -> str:
    for index, (x, y) in enumerate(itertools.zip_longest(a, b)):
        if x != y:
            return f"entry {index}: {x!r} != {y!r}"
    return "none"


# ---- the property -------------------------------------------------------------------------------


def test_b_trace_does_not_depend_on_a(index: Index) -> None:
    @settings(
        max_examples=index.examples(25),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(schedule=schedules())
    def check(schedule: Schedule) -> None:
        for slot in schedule:
            note(f"{slot}")
        baseline = trace_of_b(schedule, "removed")
        for variant in ("op", "alternative"):
            trace = trace_of_b(schedule, variant)
            assert trace == baseline, f"A's ops ({variant}) changed B's trace at " + (
                first_difference(baseline, trace)
            )

    check()


# ---- the flood ----------------------------------------------------------------------------------

B_PREFIXES: list[Seq] = [((0, 1), 5), ((1,), 0)]  # 2 extents, 3 blocks: within B's quota


def flood_schedule(rounds: int = 8, per_round: int = 5) -> Schedule:
    """B caches its prefixes; A stores far beyond its quota between B's lookups and loads."""
    schedule: Schedule = [Slot(1.0, "B", ("store", seq, "chat")) for seq in B_PREFIXES]
    for r in range(rounds):
        schedule.append(Slot(60.0, "A", ("flood", per_round)))
        seq = B_PREFIXES[r % len(B_PREFIXES)]
        schedule.append(Slot(60.0, "B", ("lookup" if r % 2 else "load", seq)))
    schedule += [Slot(1.0, "B", ("lookup", seq)) for seq in B_PREFIXES]
    return schedule


@pytest.mark.usefixtures("index")
def test_flood_does_not_evict_b() -> None:
    schedule = flood_schedule()
    baseline = trace_of_b(schedule, "removed")
    flooded = trace_of_b(schedule, "op")
    assert flooded == baseline, first_difference(baseline, flooded)
    # B's prefixes stayed cached at full length throughout, and B evicted nothing.
    full = [len(tokens_of(seq)) // BLOCK_TOKENS * BLOCK_TOKENS for seq in B_PREFIXES]
    lookups = results(flooded, "lookup")
    loads = [cached for cached, _digest in results(flooded, "load")]
    assert len(lookups) == 6 and len(loads) == 4
    assert lookups[-2:] == full and all(n in full for n in lookups + loads)
    usage = final_usage(flooded)
    assert usage["evicted_extents"] == usage["expired_extents"] == 0
    assert usage["hit_tokens"] == sum(lookups) + sum(loads)


@pytest.mark.usefixtures("index")
def test_flood_pressure_is_real() -> None:
    """Positive control for the flood: A really is over its quota, so its own oldest prefixes go,
    while its bytes stay within the quota."""
    with tempfile.TemporaryDirectory(prefix="tenantkv-ni-") as root:
        run = Run(root, shared=False)
        try:
            first = random_tokens(BLOCK_TOKENS, seed=7)
            run.ns_a.store(first, random_layers(LAYOUT, BLOCK_TOKENS))
            assert run.ns_a.lookup(first) == BLOCK_TOKENS
            for index in range(4):
                run.clock.advance(60.0)
                run.perform("A", ("flood", 5), index)
            assert run.ns_a.lookup(first) == 0
            assert 0 < run.kv.get_tenant("A").used_bytes <= QUOTA_A * extent_bytes(1)
        finally:
            run.close()


# ---- positive controls: no isolation, and the interference shows --------------------------------


@pytest.mark.usefixtures("index")
def test_shared_namespace_flood_does_interfere() -> None:
    """If "A" stores through B's namespace, its flood evicts B's prefixes: B's trace changes."""
    schedule = flood_schedule()
    baseline = trace_of_b(schedule, "removed", shared=True)
    assert baseline == trace_of_b(schedule, "removed")  # nothing of A's: same as isolated
    flooded = trace_of_b(schedule, "op", shared=True)
    assert flooded != baseline
    lookups = results(flooded, "lookup")
    assert 0 in lookups, "B's prefixes were evicted by the flood in its own namespace"


@pytest.mark.usefixtures("index")
def test_shared_namespace_store_does_interfere() -> None:
    """If "A" stores B's prefix through B's namespace first, B's own store then stores nothing;
    with separate namespaces (the same tokens in A's), B's store is unaffected."""
    seq: Seq = ((0, 1), 0)
    schedule: Schedule = [
        Slot(1.0, "A", ("store", seq, "chat")),
        Slot(1.0, "B", ("store", seq, "chat")),
        Slot(1.0, "B", ("lookup", seq)),
    ]
    isolated = trace_of_b(schedule, "op")
    assert isolated == trace_of_b(schedule, "removed")
    assert results(isolated, "store") == [2 * BLOCK_TOKENS]
    shared = trace_of_b(schedule, "op", shared=True)
    assert shared != isolated
    assert results(shared, "store") == [0]  # B's store found the blocks already cached


def test_comparison_sees_a_one_bit_change() -> None:
    """The trace comparison itself is strict: a different loaded byte changes the digest."""
    tokens = tokens_of(((0,), 0))
    layers = random_layers(LAYOUT, len(tokens), seed=1)
    same = [layer.clone() for layer in layers if isinstance(layer, torch.Tensor)]
    changed = [layer.clone() for layer in same]
    changed[-1].view(-1)[0] += 1
    assert len(same) == len(layers)
    assert digest(layers) == digest(list(same))
    assert digest(layers) != digest(list(changed))


# ---- regression: a stale handle of a deleted tenant must not break anyone's metering ------------


@pytest.mark.usefixtures("index")
def test_stale_handle_of_deleted_tenant_does_not_break_b_usage() -> None:
    """A server still holding a namespace handle of a deleted (and recreated) tenant A looks up
    through it; A's counters for the deleted tenant have nowhere to go, but B's usage must read as
    if A had done nothing. (Metering used to fail on the usage table's foreign key and then refuse
    every tenant's usage() with IntegrityError.)"""
    seq: Seq = ((0,), 0)
    schedule: Schedule = [
        Slot(1.0, "B", ("store", seq, "chat")),
        Slot(1.0, "A", ("stale_lookup", seq)),
        Slot(1.0, "B", ("lookup", seq)),
    ]
    baseline = trace_of_b(schedule, "removed")
    trace = trace_of_b(schedule, "op")
    assert trace == baseline, first_difference(baseline, trace)
