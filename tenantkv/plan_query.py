"""The index statements of a load: its read plan, and the record of its use afterwards.

Both are SQLAlchemy Core statements built once per process.

A load's first layer waits on this query, so it is cheap to run: a single SQLAlchemy Core
``select`` (no ORM session or entities) with bound parameters, constructed at import time, so a
call only binds values -- building and coercing a statement (``in_``, comparisons, joins) on
every load cost ~3x more than SQLite needs to run it. One statement also reads the block rows,
their extents and the data keys in one snapshot, so no transaction is needed to keep them
consistent with each other.

What it returns for each requested block that is indexed in the namespace and whose extent has
not expired: where the block lies (extent, slot) and what opening its extent needs (key version,
cipher suite, salt, geometry, and the wrapped data key of that version -- ``None`` when that
version was retired, which the caller must treat as a miss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, and_, bindparam, select, update

from .models import Block, DataKey, Extent, Tenant
from .retention import loads as loads_retention

_BLOCKS_WITH_EXTENTS = (
    select(
        Block.block_key,
        Block.extent_id,
        Block.slot,
        Extent.key_version,
        Extent.suite,
        Extent.salt,
        Extent.num_blocks,
        Extent.num_layers,
        Extent.segment_bytes,
        DataKey.wrapped_key,
    )
    .join(Extent, Extent.id == Block.extent_id)
    .outerjoin(
        DataKey,
        and_(DataKey.tenant_id == bindparam("tenant_id"), DataKey.version == Extent.key_version),
    )
    .where(
        Block.namespace_id == bindparam("namespace_id"),
        Block.block_key.in_(bindparam("keys", expanding=True)),
        Extent.expires_at > bindparam("now"),  # expired blocks are misses before GC runs
    )
)


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


def locate_blocks(
    connection: Connection,
    *,
    tenant_id: bytes,
    namespace_id: bytes,
    keys: Sequence[bytes],
    now: float,
) -> tuple[dict[bytes, tuple[str, int]], dict[str, ExtentRow]]:
    """``(block key -> (extent id, slot), extent id -> ExtentRow)`` of the live blocks of
    ``keys`` (at most a few hundred: the caller chunks longer requests)."""
    located: dict[bytes, tuple[str, int]] = {}
    extents: dict[str, ExtentRow] = {}
    result = connection.execute(
        _BLOCKS_WITH_EXTENTS,
        {"tenant_id": tenant_id, "namespace_id": namespace_id, "keys": list(keys), "now": now},
    )
    for (
        block_key,
        extent_id,
        slot,
        key_version,
        suite,
        salt,
        num_blocks,
        num_layers,
        segment_bytes,
        wrapped_key,
    ) in result:
        located[block_key] = (extent_id, slot)
        if extent_id not in extents:
            extents[extent_id] = ExtentRow(
                extent_id,
                key_version,
                suite,
                salt,
                num_blocks,
                num_layers,
                segment_bytes,
                wrapped_key,
            )
    return located, extents


_RETENTION = select(Tenant.retention).where(Tenant.id == bindparam("tenant_id"))
_TOUCH = (
    update(Extent)
    .where(Extent.id.in_(bindparam("ids", expanding=True)), Extent.kind == bindparam("of_kind"))
    .values(last_used_at=bindparam("used_at"), expires_at=bindparam("until"))
)


def record_use(connection: Connection, tenant_id: bytes, extent_ids: list[str], now: float) -> None:
    """Mark a tenant's extents as used at ``now``: each one's retention (by its class) restarts
    and LRU eviction sees the use. Runs after a load, in the background -- but on 2 cores it
    competes for the interpreter with the next load's first layer, hence Core statements."""
    retention_text = connection.execute(_RETENTION, {"tenant_id": tenant_id}).scalar()
    if retention_text is None:
        return  # the tenant was deleted meanwhile
    for kind, ttl in loads_retention(retention_text).items():
        connection.execute(
            _TOUCH, {"ids": extent_ids, "of_kind": kind, "used_at": now, "until": now + ttl}
        )
