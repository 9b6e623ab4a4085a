"""Block and extent rows of a namespace: which keyed blocks are cached (for stores, and for
lookups with the namespace's removal counter), and indexing a new extent's blocks (the write
half of a store)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, bindparam, delete, func, select
from sqlalchemy.orm import Session

from . import removals
from .database import Database
from .extents import CHUNK
from .schema import Block, Counter, DataKey, Extent, Namespace, Tenant


def present_keys(
    session: Session,
    namespace_id: bytes,
    keys: Sequence[bytes],
    now: float,
    *,
    stop_at_gap: bool,
) -> set[bytes]:
    """The subset of ``keys`` indexed in the namespace with an unexpired extent, queried in
    chunks. With ``stop_at_gap`` the query stops after the first chunk that misses a key,
    since nothing after a gap can extend the prefix."""
    found: set[bytes] = set()
    for start in range(0, len(keys), CHUNK):
        chunk = list(keys[start : start + CHUNK])
        rows = session.scalars(
            select(Block.block_key)
            .join(Extent, Extent.id == Block.extent_id)
            .where(
                Block.namespace_id == namespace_id,
                Block.block_key.in_(chunk),
                Extent.expires_at > now,  # expired blocks are misses before GC runs
            )
        ).all()
        found.update(rows)
        if stop_at_gap and len(rows) < len(chunk):
            break
    return found


# What a lookup reads, as prepared statements (compiled once per process by SQLAlchemy's cache).
_PRESENT_WITH_EXPIRY = (
    select(Block.block_key, Extent.expires_at)
    .join(Extent, Extent.id == Block.extent_id)
    .where(
        Block.namespace_id == bindparam("namespace_id"),
        Block.block_key.in_(bindparam("keys", expanding=True)),
        Extent.expires_at > bindparam("now"),  # expired blocks are misses before GC runs
    )
)
_CHECK = select(
    select(Counter.value).where(Counter.name == bindparam("counter")).scalar_subquery(),
    select(Extent.expires_at)
    .join(Block, Block.extent_id == Extent.id)
    .where(
        Block.namespace_id == bindparam("namespace_id"),
        Block.block_key == bindparam("probe"),
        Extent.expires_at > bindparam("now"),
    )
    .scalar_subquery(),
).where(Namespace.id == bindparam("namespace_id"))


def present_with_expiry(
    connection: Connection,
    namespace_id: bytes,
    keys: Sequence[bytes],
    now: float,
    *,
    stop_at_gap: bool,
) -> dict[bytes, float]:
    """Like :func:`present_keys`, with the expiry time of each present key's extent (what a
    node's lookup structure keeps, ``tenantkv.components.lookup_cache``)."""
    found: dict[bytes, float] = {}
    for start in range(0, len(keys), CHUNK):
        chunk = list(keys[start : start + CHUNK])
        rows = connection.execute(
            _PRESENT_WITH_EXPIRY, {"namespace_id": namespace_id, "keys": chunk, "now": now}
        ).all()
        for key, expires_at in rows:
            found[bytes(key)] = float(expires_at)
        if stop_at_gap and len(rows) < len(chunk):
            break
    return found


@dataclass(frozen=True)
class LookupCheck:
    """What one statement tells a lookup that holds some of a namespace's keys already."""

    #: The namespace's removal counter now (``index.removals``): equal to the value the held
    #: keys were read under, nothing has left since.
    removals: int
    #: Expiry of the probed key's extent, or None when that key is not present (or no key was
    #: probed).
    probe_expires_at: float | None


def check_lookup(
    connection: Connection,
    namespace_id: bytes,
    counter: str,
    probe: bytes | None,
    now: float,
) -> LookupCheck | None:
    """The namespace's removal counter (named ``counter``) and whether ``probe`` is present,
    in one statement (one snapshot, one round trip); None when the namespace is gone (its
    tenant was deleted: every lookup is a miss)."""
    row = connection.execute(
        _CHECK,
        {
            "namespace_id": namespace_id,
            "counter": counter,
            "probe": b"" if probe is None else probe,  # no key is empty: matches nothing
            "now": now,
        },
    ).one_or_none()
    if row is None:
        return None
    removals, probe_expires_at = row
    return LookupCheck(
        int(removals or 0), None if probe_expires_at is None else float(probe_expires_at)
    )


@dataclass(frozen=True)
class WriteSettings:
    """What a store needs of its tenant, read in one snapshot."""

    key_version: int
    wrapped_key: bytes | None  # None: the version's key is gone
    quota_bytes: int
    retention: str  # JSON, see ``tenantkv.retention``


def write_settings(session: Session, tenant_id: bytes) -> WriteSettings | None:
    row = session.execute(
        select(Tenant.current_key_version, Tenant.quota_bytes, Tenant.retention).where(
            Tenant.id == tenant_id
        )
    ).one_or_none()
    if row is None:
        return None
    version, quota, retention = row
    wrapped = session.scalar(
        select(DataKey.wrapped_key).where(
            DataKey.tenant_id == tenant_id, DataKey.version == version
        )
    )
    return WriteSettings(version, wrapped, quota, retention)


def lock_quota(session: Session, tenant_id: bytes) -> int | None:
    """The tenant's quota, its row locked: serialises quota accounting per tenant across
    processes (a no-op on SQLite, whose write transactions are already exclusive)."""
    return session.scalar(
        select(Tenant.quota_bytes).where(Tenant.id == tenant_id).with_for_update()
    )


def index_blocks(
    db: Database,
    session: Session,
    extent: Extent,
    keys: Sequence[bytes],
    positions: Sequence[int],
) -> int:
    """Add ``extent`` and its blocks (``keys[p]`` for each position, slot by slot); return how
    many blocks it got. Blocks another extent already holds are skipped (a concurrent store
    won them); an extent that got none is removed again."""
    namespace_id, now = extent.namespace_id, extent.created_at
    session.add(extent)
    session.flush()
    # Rows of these blocks left by an expired extent (not yet collected) would make the insert
    # skip them, so an expired prefix could not be stored again until GC.
    expired = select(Extent.id).where(Extent.namespace_id == namespace_id, Extent.expires_at <= now)
    replaced = 0
    for start in range(0, len(positions), CHUNK):
        chunk = [keys[p] for p in positions[start : start + CHUNK]]
        result = session.execute(
            delete(Block).where(
                Block.namespace_id == namespace_id,
                Block.block_key.in_(chunk),
                Block.extent_id.in_(expired),
            )
        )
        replaced += getattr(result, "rowcount", 0) or 0
    if replaced:
        # Misses already by their expiry here; counted for nodes whose clocks run behind.
        removals.bump(session, [namespace_id])
    session.execute(
        db.insert_ignoring_duplicates(Block.__table__),
        [
            {
                "namespace_id": namespace_id,
                "block_key": keys[position],
                "extent_id": extent.id,
                "slot": slot,
                "position": position,
                "stored_at": now,
                "last_used_at": now,
            }
            for slot, position in enumerate(positions)
        ],
    )
    inserted = int(
        session.scalar(select(func.count()).select_from(Block).where(Block.extent_id == extent.id))
        or 0
    )
    if not inserted:
        session.execute(delete(Extent).where(Extent.id == extent.id))
    return inserted


def cached_positions(session: Session, namespace_id: bytes) -> list[int]:
    return list(
        session.scalars(select(Block.position).where(Block.namespace_id == namespace_id)).all()
    )
