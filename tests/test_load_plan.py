"""A load's read plan: every block must be live, keyed and laid out as this namespace expects.

The plan is a few index statements (see ``tenantkv/index/plan.py``): the blocks run by run, then
their extents. These tests change the index under a stored prefix and check that the load
becomes a miss -- with a positive control that the same load succeeds before the change -- and
that plans spanning several query chunks and extents, or scattered over extents, still load
exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import delete, update
from sqlalchemy.dialects import postgresql, sqlite

import tenantkv
from tenantkv import CacheMissError, KVLayout, TenantKV
from tenantkv.datapath.loader import split_chunks
from tenantkv.index import plan as plan_module
from tenantkv.index.plan import ExtentRow, _rendered, locate_blocks
from tenantkv.index.schema import Block, DataKey, Extent
from tests.helpers import (
    ManualClock,
    layers_equal,
    load_all,
    prefix_of,
    random_layers,
    random_tokens,
)

MLA = KVLayout.mla(3, kv_lora_rank=48, rope_dim=16, dtype=torch.bfloat16)


def _stored(kv: TenantKV, blocks: int = 2) -> tuple[tenantkv.Namespace, list[int]]:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(blocks * 64)
    ns.store(tokens, random_layers(MLA, len(tokens)))
    assert len(load_all(ns, tokens)) == MLA.num_layers  # positive control
    return ns, tokens


def test_a_retired_key_version_makes_the_load_a_miss(kv: TenantKV) -> None:
    ns, tokens = _stored(kv)
    with kv.context.index.write() as session:
        session.execute(delete(DataKey))
    with pytest.raises(CacheMissError, match="data key version"):
        ns.load(tokens)


def test_an_extent_of_another_geometry_is_a_miss(kv: TenantKV) -> None:
    ns, tokens = _stored(kv)
    with kv.context.index.write() as session:
        session.execute(update(Extent).values(num_layers=MLA.num_layers + 1))
    with pytest.raises(CacheMissError, match="layout"):
        ns.load(tokens)


@pytest.mark.usefixtures("index")
def test_an_expired_extent_is_a_miss_before_gc(tmp_path: Path) -> None:
    clock = ManualClock()
    with tenantkv.open(tmp_path / "cache", durable=False, clock=clock) as kv:
        ns, tokens = _stored(kv)
        clock.now += 365 * 86_400.0
        with pytest.raises(CacheMissError, match="only 0 of 128 tokens"):
            ns.load(tokens)


def test_a_gap_in_the_prefix_is_a_miss(kv: TenantKV) -> None:
    ns, tokens = _stored(kv, blocks=2)
    other = tokens[:64] + random_tokens(64, seed=9)
    with pytest.raises(CacheMissError, match="only 64 of 128 tokens"):
        ns.load(other)


@pytest.mark.parametrize("short_run", [1, 100], ids=["scanned", "in-lists"])
def test_plans_spanning_query_chunks_and_extents_load_exactly(
    kv: TenantKV, monkeypatch: pytest.MonkeyPatch, short_run: int
) -> None:
    # Each run in an extent scanned, or IN lists after the first run (as for scattered runs),
    # of 2 keys a statement: 7 blocks, 4 statements.
    monkeypatch.setattr(plan_module, "SHORT_RUN", short_run)
    monkeypatch.setattr(plan_module, "CHUNK", 2)
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(7 * 64)
    layers = random_layers(MLA, len(tokens))
    ns.store(tokens[: 3 * 64], [prefix_of(layer, 3 * 64) for layer in layers])
    ns.store(tokens, layers)  # blocks 3..6 in a second extent
    for got, want in zip(load_all(ns, tokens), layers, strict=True):
        assert layers_equal(got, want)
    with pytest.raises(CacheMissError, match="only 384 of 448 tokens"):
        ns.load(tokens[: 6 * 64] + random_tokens(64, seed=5))


def _locate(
    kv: TenantKV, ns: tenantkv.Namespace, keys: list[bytes], *, prefix: bool
) -> tuple[dict[bytes, tuple[str, int]], dict[str, ExtentRow]]:
    with kv.context.index.read_connection() as connection:
        return locate_blocks(
            connection,
            tenant_id=ns.identity.tenant_id,
            namespace_id=ns.identity.namespace_id,
            keys=keys,
            now=kv.context.clock(),
            prefix=prefix,
        )


@pytest.mark.parametrize("short_run", [1, 4, 100])
def test_scanned_plans_find_what_in_lists_find_in_scattered_extents(
    kv: TenantKV, monkeypatch: pytest.MonkeyPatch, short_run: int
) -> None:
    """A plan scans each run of a prefix in its extent and takes a row only while it holds the
    next key. Extents whose slots hold scattered positions (blocks stored
    around others already cached), slots left empty by removed blocks and prefixes that leave
    an extent midway must give the plan that one IN-list probe per key gives, and the load must
    give back the stored bytes."""
    monkeypatch.setattr(plan_module, "SHORT_RUN", short_run)
    monkeypatch.setattr(plan_module, "CHUNK", 2)  # 3 extents: their rows in two statements
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(12 * 64)
    layers = random_layers(MLA, len(tokens))
    keys = ns._keys(tokens)
    ns.store(tokens[: 3 * 64], [prefix_of(layer, 3 * 64) for layer in layers])  # extent A: 0-2
    ns.store(tokens, layers)  # extent B: blocks 3-11 at slots 0-8
    # Blocks 5, 6 and 9 leave the index (B's slots 2, 3 and 6 empty), then come back stored
    # again: extent C holds blocks 5, 6, 9 at slots 0, 1, 2.
    with kv.context.index.write() as session:
        session.execute(delete(Block).where(Block.block_key.in_([keys[5], keys[6], keys[9]])))
    ns.store(tokens, layers)
    extent_of = {key: place[0] for key, place in _locate(kv, ns, keys, prefix=False)[0].items()}
    assert len(set(extent_of.values())) == 3  # the layout the test means to build
    assert extent_of[keys[5]] == extent_of[keys[6]] == extent_of[keys[9]] != extent_of[keys[4]]
    diverging = ns._keys(tokens[: 7 * 64] + random_tokens(5 * 64, seed=3))
    for wanted in (keys, keys[:6], keys[4:], keys[5:], diverging):
        scanned, scanned_extents = _locate(kv, ns, wanted, prefix=True)
        probed, probed_extents = _locate(kv, ns, wanted, prefix=False)
        run = ns._run_from_zero(wanted, probed)
        assert ns._run_from_zero(wanted, scanned) == run
        assert all(scanned[key] == probed[key] for key in wanted[:run])
        assert set(scanned) <= set(probed)
        assert {probed[key][0] for key in wanted[:run]} <= set(scanned_extents)
        assert scanned_extents.items() <= probed_extents.items()
    assert ns._run_from_zero(diverging, _locate(kv, ns, diverging, prefix=True)[0]) == 7
    for got, want in zip(load_all(ns, tokens), layers, strict=True):
        assert layers_equal(got, want)


@pytest.mark.parametrize("wanted", [1, 2, 3, 5, 8, 9])
def test_plan_query_finds_exactly_the_indexed_keys_of_any_count(kv: TenantKV, wanted: int) -> None:
    """The IN list is padded to a power of two with a repeated key: the plan must still have
    exactly the requested blocks, at their slots, and nothing for keys that are not indexed."""
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(9 * 64)
    ns.store(tokens, random_layers(MLA, len(tokens)))
    keys = ns._keys(tokens)
    absent = ns._keys(random_tokens(2 * 64, seed=99))
    located, extents = _locate(kv, ns, [*keys[:wanted], *absent], prefix=False)
    assert set(located) == set(keys[:wanted])
    assert [located[key][1] for key in keys[:wanted]] == list(range(wanted))
    assert len(extents) == 1 and next(iter(extents.values())).wrapped_key is not None


def test_plan_query_renders_for_each_driver_parameter_style() -> None:
    """SQLite takes positional parameters in the SQL's order, psycopg named ones (no PostgreSQL
    driver is needed to render)."""
    values = {"tenant_id": b"t", "namespace_id": b"n", "now": 1.0}
    keys = [b"a", b"b"]
    blocks = _rendered(sqlite.dialect(), "blocks", 2)
    assert blocks.sql.count("?") == 3
    assert blocks.parameters(values, keys) == (b"n", b"a", b"b")
    extents = _rendered(sqlite.dialect(), "extents", 2)
    assert extents.sql.count("?") == 5
    assert extents.parameters(values, keys) == (b"t", b"n", b"a", b"b", 1.0)
    for statement in ("blocks", "extents"):
        named = _rendered(postgresql.psycopg.dialect(), statement, 2)
        assert "IN (%(key0)s, %(key1)s)" in named.sql
        assert named.parameters(values, keys) == {**values, "key0": b"a", "key1": b"b"}


@pytest.mark.usefixtures("index")
@pytest.mark.parametrize("prefix", [True, False], ids=["scanned", "in-lists"])
def test_an_extent_removed_between_the_plan_statements_is_never_half_planned(
    kv: TenantKV, monkeypatch: pytest.MonkeyPatch, prefix: bool
) -> None:
    """The blocks and their extents are separate statements. An extent removed between them
    (with its blocks) is found by both on SQLite, whose read transaction is one snapshot, and by
    neither on PostgreSQL, whose statements each see their own: either way no block is located
    in an extent the plan has no row for."""
    ns, tokens = _stored(kv, blocks=2)
    keys = ns._keys(tokens)

    def plan() -> tuple[dict[bytes, tuple[str, int]], dict[str, ExtentRow]]:
        return _locate(kv, ns, keys, prefix=prefix)

    located, extents = plan()  # positive control: every block, in its one extent
    assert set(located) == set(keys) and len(extents) == 1
    run = plan_module._run

    def remove_then_run(connection: Any, statement: str, *args: Any) -> Any:
        if statement == "extents":
            with kv.context.index.write() as session:
                session.execute(delete(Block))
                session.execute(delete(Extent))
        return run(connection, statement, *args)

    monkeypatch.setattr(plan_module, "_run", remove_then_run)
    located, extents = plan()
    assert all(extent_id in extents for extent_id, _slot in located.values())
    if kv.context.index.dialect == "sqlite":
        assert set(located) == set(keys)
    else:
        assert located == {} and extents == {}


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("max_segments", [1, 3, 7, 100])
def test_chunks_cover_every_segment_once_in_a_multiple_of_workers(
    kv: TenantKV, workers: int, max_segments: int
) -> None:
    """Layer 0 is cut for twice the workers, later layers for the workers: either way every
    segment of every run lies in exactly one chunk, no chunk exceeds a slot, and a run with
    enough segments is cut into a multiple of the workers."""
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA)
    tokens = random_tokens(11 * 64)
    layers = random_layers(MLA, len(tokens))
    ns.store(tokens[: 4 * 64], [prefix_of(layer, 4 * 64) for layer in layers])
    ns.store(tokens, layers)
    with kv.context.index.read_connection() as connection:
        plan = ns._plan(connection, ns._keys(tokens))
    for cut in (workers, 2 * workers):
        chunks = split_chunks(plan, max_segments, cut)
        covered = [chunk.position + i for chunk in chunks for i in range(chunk.count)]
        assert covered == list(range(plan.num_blocks))
        assert all(1 <= chunk.count <= max_segments for chunk in chunks)
        for run in plan.runs:
            pieces = sum(chunk.run is run for chunk in chunks)
            assert pieces % cut == 0 or pieces == run.count
