"""The index statements of a load: its read plan, and the record of its use afterwards.

A load's first layer waits on the plan, so it is cheap to read: SQLAlchemy Core ``select``
statements (no ORM session or entities), the blocks' places and then their extents with the
data keys, each rendered to SQL once per database driver and IN-list size (the next power of two
of the number of keys, padded with a repeated key) and run with the driver's own parameters:
building and coercing a statement on every load cost several times what SQLite needs to run
it, and expanding an IN list per call more again (docs/perf.md).

The blocks of a prefix are found run by run: a store writes its new blocks in order, so a
prefix lies in runs of consecutive slots of a few extents, and one statement finds a run's
first key and reads the rest of the run from the index on ``(extent_id, slot, namespace_id,
block_key)``, where probing every key cost ~1.5 us a key on SQLite (2,048 keys at 128K tokens:
~5 ms against ~1.8). Extents holding short, scattered runs are probed by ``IN`` lists instead.

The blocks' places and their extents are separate statements rather than one join: a prefix's
blocks lie in a few extents, and repeating each extent's columns on every block row cost SQLite
twice the time (0.50 against 0.25 ms for 128 blocks, plus ~0.05 ms for the extents). An extent
and its data key are read in one statement; a block whose extent that statement no longer finds
(removed in between, on PostgreSQL's per-statement snapshots) is a miss. The record of use is a
prebuilt Core statement too, after one that locks its extent rows in id order on PostgreSQL
(:func:`record_use`).

What it returns for each requested block that is indexed in the namespace and whose extent has
not expired: where the block lies (extent, slot) and what opening its extent needs (key version,
cipher suite, salt, geometry, and the wrapped data key of that version -- ``None`` when that
version was retired, which the caller must treat as a miss).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Connection,
    Dialect,
    Float,
    Integer,
    Select,
    String,
    Update,
    and_,
    any_,
    bindparam,
    select,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import aliased

from ..retention import loads as loads_retention
from .extents import CHUNK, retention_by_class, retention_parameters
from .schema import Block, DataKey, Extent, Tenant


def _blocks(count: int) -> Select[*tuple[Any, ...]]:
    """Where ``count`` block keys of a namespace lie, bound as ``key0 .. key{count-1}``."""
    return select(Block.block_key, Block.extent_id, Block.slot).where(
        Block.namespace_id == bindparam("namespace_id"),
        Block.block_key.in_([bindparam(f"key{i}") for i in range(count)]),
    )


def _extents(count: int) -> Select[*tuple[Any, ...]]:
    """What opening ``count`` extents of a namespace needs, bound as ``key0 .. key{count-1}``
    (their ids), with the wrapped data key of each one's version."""
    return (
        select(
            Extent.id,
            Extent.key_version,
            Extent.suite,
            Extent.salt,
            Extent.num_blocks,
            Extent.num_layers,
            Extent.segment_bytes,
            DataKey.wrapped_key,
        )
        .outerjoin(
            DataKey,
            and_(
                DataKey.tenant_id == bindparam("tenant_id"),
                DataKey.version == Extent.key_version,
            ),
        )
        .where(
            Extent.namespace_id == bindparam("namespace_id"),
            Extent.id.in_([bindparam(f"key{i}") for i in range(count)]),
            Extent.expires_at > bindparam("now"),  # expired blocks are misses before GC runs
        )
    )


def _run_in_extent(count: int) -> Select[*tuple[Any, ...]]:
    """The block of a namespace keyed ``key0`` and the blocks after it in its extent, by slot:
    up to ``span`` of them from its own slot on (``count`` is 1: the one key). Read through
    ``ix_tkv_blocks_extent_slot``, which holds every column asked for, so no table row is read
    for the run."""
    probe = aliased(Block, name="probe")
    span = bindparam("span", type_=Integer())
    return (
        select(Block.block_key, Block.extent_id, Block.slot)
        .select_from(probe)
        .join(
            Block,
            and_(
                Block.extent_id == probe.extent_id,
                Block.slot >= probe.slot,
                Block.slot < probe.slot + span,
            ),
        )
        .where(
            probe.namespace_id == bindparam("namespace_id"),
            probe.block_key.in_([bindparam(f"key{i}") for i in range(count)]),
            Block.namespace_id == bindparam("namespace_id"),
        )
        .order_by(Block.slot)
    )


_STATEMENTS = {"blocks": _blocks, "extents": _extents, "run_in_extent": _run_in_extent}


@dataclass(frozen=True, slots=True)
class _RenderedQuery:
    """A statement rendered once for one database driver: its SQL in the driver's parameter
    style and how its parameters are bound: for positional styles the names before and after
    its IN list's keys (``key0 ..``, consecutive: one IN list per statement), for named
    styles the keys' names."""

    sql: str
    positional: bool
    before: tuple[str, ...]  # positional: the parameters ahead of the keys
    after: tuple[str, ...]  # positional: the parameters after the keys
    key_names: tuple[str, ...]  # named: "key0", "key1", ...

    def parameters(self, values: dict[str, Any], keys: Sequence[Any]) -> Any:
        """The driver's parameters: ``values`` by name and ``keys`` as ``key0 ..``."""
        if self.positional:
            before = [values[name] for name in self.before]
            return (*before, *keys, *[values[name] for name in self.after])
        return {**values, **dict(zip(self.key_names, keys, strict=True))}


_RENDERED: dict[tuple[str, str, str, str, int], _RenderedQuery] = {}


def _rendered(dialect: Dialect, statement: str, count: int) -> _RenderedQuery:
    """The plan statement ``statement`` (a key of ``_STATEMENTS``) for ``count`` keys as
    ``dialect``'s driver takes it, rendered once per driver and count (engines have dialect
    objects of their own; their SQL is the same)."""
    cache_key = (dialect.name, dialect.driver, dialect.paramstyle, statement, count)
    query = _RENDERED.get(cache_key)
    if query is None:
        compiled = _STATEMENTS[statement](count).compile(dialect=dialect)
        key_names = tuple(f"key{i}" for i in range(count))
        if compiled.positional and compiled.positiontup is not None:
            order = tuple(compiled.positiontup)
            first = order.index("key0")
            if order[first : first + count] != key_names:
                raise AssertionError(f"{statement}: the IN list's parameters are not in a row")
            query = _RenderedQuery(compiled.string, True, order[:first], order[first + count :], ())
        else:
            query = _RenderedQuery(compiled.string, False, (), (), key_names)
        query = _RENDERED.setdefault(cache_key, query)
    return query


def _key_bucket(count: int) -> int:
    """The number of IN-list parameters a query of ``count`` keys is rendered with: the next
    power of two, so a handful of rendered statements serve every request length."""
    return 1 << max(0, count - 1).bit_length()


@dataclass(frozen=True, slots=True)
class ExtentRow:
    """What opening one extent needs, as the index has it."""

    extent_id: str
    key_version: int
    suite: int
    salt: bytes
    num_blocks: int
    num_layers: int
    segment_bytes: int
    wrapped_key: bytes | None  # None: the key version is gone (retired or shredded)


def _run(
    connection: Connection, statement: str, keys: Sequence[Any], values: dict[str, Any]
) -> Any:
    """Run the plan statement ``statement`` for ``keys`` (its IN list, padded to a power of two
    with a repeated key, which matches no extra row) with the other ``values``."""
    bucket = _key_bucket(len(keys))
    query = _rendered(connection.dialect, statement, bucket)
    padded = [*keys, *[keys[-1]] * (bucket - len(keys))]
    return connection.exec_driver_sql(query.sql, query.parameters(values, padded))


#: A run in one extent shorter than this ends the scan of a prefix: its extents hold short,
#: scattered runs (blocks stored around others already cached), and ``IN`` lists find the
#: rest in fewer statements than one scan per run would take.
SHORT_RUN = 16

Located = dict[bytes, tuple[str, int]]


def _find_blocks(
    connection: Connection, namespace_id: bytes, keys: Sequence[bytes], *, stop_at_gap: bool
) -> Located:
    """``block key -> (extent id, slot)`` of the indexed keys among ``keys``, in ``IN`` lists of
    :data:`CHUNK`. With ``stop_at_gap`` it stops after the first list that misses a key (as
    ``blocks.present_keys`` does), since nothing after a gap can extend a prefix."""
    located: Located = {}
    for start in range(0, len(keys), CHUNK):
        chunk = keys[start : start + CHUNK]
        rows = _run(connection, "blocks", chunk, {"namespace_id": namespace_id}).fetchall()
        located.update((bytes(key), (extent_id, slot)) for key, extent_id, slot in rows)
        if stop_at_gap and len(rows) < len(chunk):
            break
    return located


def _scan_prefix(connection: Connection, namespace_id: bytes, keys: Sequence[bytes]) -> Located:
    """``block key -> (extent id, slot)`` of the indexed keys of ``keys`` from the first on, up
    to the first key that is not indexed (where a load's prefix ends; later keys may be
    missing from the result).

    A prefix's blocks lie in runs of consecutive slots of a few extents (a store writes its new
    blocks in order), so one statement per run finds its first key and reads the rows after it
    in its extent, and each row is taken only while it holds the next key: one statement per
    run instead of one index probe per key. Extents holding short runs are left to ``IN``
    lists (:data:`SHORT_RUN`)."""
    located: Located = {}
    done = 0
    values: dict[str, Any] = {"namespace_id": namespace_id}
    while done < len(keys):
        values["span"] = len(keys) - done
        rows = _run(connection, "run_in_extent", keys[done : done + 1], values).fetchall()
        # The rows, in slot order, hold the run's keys: compared as whole lists (in C), and
        # row by row only to find where a run ends (0.4 ms less at 2,048 blocks; docs/perf.md).
        expected = list(keys[done : done + len(rows)])
        found = [row[0] for row in rows]
        run = len(rows)
        if found != expected:
            pairs = zip(found, expected, strict=False)  # the span bounds the rows: never longer
            run = next((i for i, (got, want) in enumerate(pairs) if got != want), len(expected))
        located.update(zip(expected[:run], [(row[1], row[2]) for row in rows[:run]], strict=True))
        done += run
        if run == 0:
            break  # keys[done] is not indexed: the prefix ends here
        if run < SHORT_RUN and done < len(keys):
            located.update(_find_blocks(connection, namespace_id, keys[done:], stop_at_gap=True))
            break
    return located


def locate_blocks(
    connection: Connection,
    *,
    tenant_id: bytes,
    namespace_id: bytes,
    keys: Sequence[bytes],
    now: float,
    prefix: bool = False,
) -> tuple[Located, dict[str, ExtentRow]]:
    """``(block key -> (extent id, slot), extent id -> ExtentRow)`` of the live blocks of
    ``keys``; with ``prefix``, of the keys from the first on up to the first one not indexed
    (a load's plan: runs in extents are scanned, see :func:`_scan_prefix`).

    Then one statement for the blocks' (few) extents. A block whose extent that statement finds
    gone or expired -- on PostgreSQL it may have been removed in between -- is left out, so a
    race with a removal is a miss, never a plan pointing at bytes that are gone."""
    extents: dict[str, ExtentRow] = {}
    if not keys:
        return {}, extents
    if prefix:
        blocks = _scan_prefix(connection, namespace_id, keys)
    else:
        blocks = _find_blocks(connection, namespace_id, keys, stop_at_gap=False)
    if not blocks:
        return {}, extents
    extent_ids = list({extent_id for extent_id, _slot in blocks.values()})
    values = {"tenant_id": tenant_id, "namespace_id": namespace_id, "now": now}
    # In IN lists of at most CHUNK too: a long prefix grown a block at a time has an extent per
    # block, more extents than one statement may bind.
    for start in range(0, len(extent_ids), CHUNK):
        for (
            extent_id,
            key_version,
            suite,
            salt,
            num_blocks,
            num_layers,
            segment_bytes,
            wrapped_key,
        ) in _run(connection, "extents", extent_ids[start : start + CHUNK], values):
            # Driver values: some drivers return binary columns as memoryview, not bytes.
            extents[extent_id] = ExtentRow(
                extent_id,
                key_version,
                suite,
                bytes(salt),
                num_blocks,
                num_layers,
                segment_bytes,
                None if wrapped_key is None else bytes(wrapped_key),
            )
    located = {key: place for key, place in blocks.items() if place[0] in extents}
    return located, extents


# FOR SHARE: recording use waits for the transactions that change the tenant's extents (they
# lock its row first, see quota.lock_tenants) instead of deadlocking with them on PostgreSQL.
_RETENTION = (
    select(Tenant.retention).where(Tenant.id == bindparam("tenant_id")).with_for_update(read=True)
)

# The extent rows a record of use will update, locked in id order before any of them is
# updated: FOR NO KEY UPDATE is the lock the UPDATEs take themselves (so it conflicts with
# nothing they did not), and PostgreSQL locks the rows in the order the ORDER BY returns them.
# The ids are one array parameter: a batch's extents, of every time of use together, may be
# more than one statement may bind one by one. PostgreSQL only (see record_use).
_LOCK_EXTENTS = (
    select(Extent.id)
    .where(Extent.id == any_(bindparam("ids", type_=postgresql.ARRAY(String()))))
    .order_by(Extent.id)
    .with_for_update(key_share=True)
)


@functools.cache
def _touch(classes: int) -> Update:
    """The record-of-use statement for a tenant with ``classes`` retention classes (at most
    ``retention.MAX_RETENTION_CLASSES``, so few are ever built): one UPDATE whatever the
    number of classes, each extent's expiry taken from its own class. An extent whose recorded
    use is already later is left alone: records of use from several nodes commit in any order,
    and an older one must not move its LRU time and expiry back."""
    kinds, ttl = retention_by_class(classes)
    used_at = bindparam("used_at", type_=Float())
    return (
        update(Extent)
        .where(
            Extent.id.in_(bindparam("ids", expanding=True)),
            Extent.kind.in_(kinds),
            Extent.last_used_at <= used_at,
        )
        .values(last_used_at=used_at, expires_at=used_at + ttl)
    )


def record_use(
    connection: Connection, tenant_id: bytes, uses: Mapping[float, Collection[str]]
) -> dict[str, float]:
    """Mark a tenant's extents as used: ``uses`` maps a time to the extents used then. Each
    one's retention (by its class) restarts and LRU eviction sees the use (never moved back by
    an older record, see :func:`_touch`). Runs after loads, in the background -- but on 2 cores
    it competes for the interpreter with the next load's first layer, hence Core statements:
    one to read the retention, then one UPDATE per time however many classes the tenant has.
    Returns the tenant's retention classes (none if it was deleted), for block stores that
    expire extents themselves.

    On PostgreSQL one statement first locks every extent row the UPDATEs will touch, in id
    order. Records of use of one tenant run side by side (several nodes, each one's batch: the
    tenant's row is only shared-locked), and an UPDATE per time locked the rows of each time
    in turn, so two batches holding the same extents at different times locked them in
    different orders and deadlocked, losing one batch. A single UPDATE from a list of ``(id,
    time)`` values would save this round trip but not fix it: a statement's plan, not the
    list, decides the order in which it locks rows; so one ordered lock per batch, which the
    UPDATEs then need not wait for again, is the cheapest fix. The lock comes after the
    tenant's row, as in every transaction that changes extents (quota.lock_tenants), so it
    adds no new order. SQLite runs one write transaction at a time and has no row locks: it
    skips the statement."""
    retention_text = connection.execute(_RETENTION, {"tenant_id": tenant_id}).scalar()
    if retention_text is None:
        return {}  # the tenant was deleted meanwhile
    classes = loads_retention(retention_text)
    if not classes:
        return classes
    if connection.dialect.name == "postgresql":
        ids = sorted({extent_id for extent_ids in uses.values() for extent_id in extent_ids})
        if ids:
            connection.execute(_LOCK_EXTENTS, {"ids": ids}).all()
    for used_at, extent_ids in uses.items():
        if extent_ids:
            connection.execute(
                _touch(len(classes)),
                {"ids": list(extent_ids), "used_at": used_at, **retention_parameters(classes)},
            )
    return classes
