"""Leases on extents being read: the index rows that replace a per-process pin counter.

A load takes one lease (a random id) over the extents of its plan, in the same write
transaction as the plan, and gives it back when it ends. Every path that removes an extent
asks this module which extents are leased, on any node:

* eviction, GC of expired extents, re-sealing and purges pass leased extents over;
* the one delete path (rows first, bytes after the commit) keeps a leased extent's bytes, and
  the load that held the last lease removes them when it ends (or the orphan sweep does, once
  the lease has lapsed).

Leases expire: a node renews the leases of its running loads, so a node that dies mid-load
releases its claims after ``expires_at`` without anyone's help. Times are the nodes' wall
clocks; keep lease lifetimes far above the clock skew of the fleet.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from sqlalchemy import Connection, bindparam, delete, insert, select, update
from sqlalchemy.orm import Session

from .schema import Lease

_ACQUIRE = insert(Lease)
_RELEASE = delete(Lease).where(Lease.lease_id == bindparam("lease"))
_RENEW = (
    update(Lease)
    .where(Lease.lease_id.in_(bindparam("leases", expanding=True)))
    .values(expires_at=bindparam("until"))
)
_LEASED_AMONG = select(Lease.extent_id).where(
    Lease.extent_id.in_(bindparam("ids", expanding=True)), Lease.expires_at > bindparam("now")
)
_ALL_LEASED = select(Lease.extent_id).where(Lease.expires_at > bindparam("now"))
_LAPSED = delete(Lease).where(Lease.expires_at <= bindparam("now"))
# SQLite allows 32,766 bound parameters; stay far below it and below PostgreSQL's limits.
_CHUNK = 500

Executor = Connection | Session


def acquire(
    executor: Executor, lease_id: bytes, node_id: str, extent_ids: Iterable[str], until: float
) -> None:
    """Claim ``extent_ids`` for one load until ``until`` (in the caller's transaction)."""
    rows = [
        {"lease_id": lease_id, "extent_id": extent_id, "node_id": node_id, "expires_at": until}
        for extent_id in dict.fromkeys(extent_ids)
    ]
    if rows:
        executor.execute(_ACQUIRE, rows)


def release(executor: Executor, lease_id: bytes) -> None:
    executor.execute(_RELEASE, {"lease": lease_id})


def renew(executor: Executor, lease_ids: Collection[bytes], until: float) -> None:
    """Extend the given leases (a node's running loads) to ``until``."""
    ids = list(lease_ids)
    for start in range(0, len(ids), _CHUNK):
        executor.execute(_RENEW, {"leases": ids[start : start + _CHUNK], "until": until})


def leased(executor: Executor, extent_ids: Collection[str] | None, now: float) -> set[str]:
    """Which of ``extent_ids`` (all extents, with ``None``) hold a live lease of any node."""
    if extent_ids is None:
        return {str(row) for row in executor.execute(_ALL_LEASED, {"now": now}).scalars()}
    ids = list(extent_ids)
    found: set[str] = set()
    for start in range(0, len(ids), _CHUNK):
        result = executor.execute(_LEASED_AMONG, {"ids": ids[start : start + _CHUNK], "now": now})
        found.update(str(row) for row in result.scalars())
    return found


def drop_lapsed(executor: Executor, now: float) -> int:
    """Remove leases that expired (their nodes stopped renewing them); return how many."""
    result = executor.execute(_LAPSED, {"now": now})
    return int(getattr(result, "rowcount", 0) or 0)
