"""Per-namespace removal counters: how each node's lookup structure learns that blocks left.

A node keeps the keys its lookups found present (``tenantkv.components.lookup_cache``) and
answers later lookups from them after one check: that nothing left the namespace since.
Anything that makes an indexed block of a namespace a miss adds one to the namespace's counter,
in the transaction that does it:

* extent rows deleted (:func:`tenantkv.index.extents.delete_rows`, the one delete path:
  eviction, GC, purge, re-sealing, a damaged or lost extent);
* block rows of expired extents replaced by a store (``index.blocks.index_blocks``);
* retention changed (expiry times may move earlier; ``index.tenants.restart_retention``).

Deleting a tenant deletes its namespaces (a lookup then finds no namespace row, which is a miss
by itself) and their counters. Adding blocks changes no counter: a lookup asks the index about
the first key the structure does not hold, so it sees new blocks at once.

The counters are rows of ``tkv_counters`` named ``removals:<namespace id hex>`` (the table of
the key epoch, which does the same for cached clear keys), created at the first removal; a
namespace without one has had none (value 0).
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import Connection, Executable, delete, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from .schema import Counter

_PREFIX = "removals:"


def counter_name(namespace_id: bytes) -> str:
    """The name of the namespace's removal counter (41 characters, within ``Counter.name``)."""
    return _PREFIX + namespace_id.hex()


def bump(executor: Session | Connection, namespace_ids: Collection[bytes]) -> None:
    """Add one to the removal counter of each namespace, in the caller's transaction.

    Counters are created (at 0, then counted) where missing, and changed in name order, so
    that two transactions bumping the same counters on PostgreSQL wait for each other instead
    of deadlocking."""
    names = sorted({counter_name(namespace_id) for namespace_id in namespace_ids})
    if not names:
        return
    bind = executor.get_bind() if isinstance(executor, Session) else executor
    dialect = bind.dialect.name
    create: Executable
    if dialect == "sqlite":
        create = sqlite.insert(Counter).on_conflict_do_nothing()
    elif dialect == "postgresql":
        create = postgresql.insert(Counter).on_conflict_do_nothing()
    else:
        raise NotImplementedError(f"database dialect {dialect!r} is not supported")
    executor.execute(create, [{"name": name, "value": 0} for name in names])
    executor.execute(
        update(Counter)
        .where(Counter.name.in_(names))
        .values(value=Counter.value + 1)
        .execution_options(synchronize_session=False)
    )


def forget(executor: Session | Connection, namespace_ids: Collection[bytes]) -> None:
    """Delete the counters of namespaces that are being deleted (housekeeping: a lookup in a
    namespace without a row is a miss whatever its counter says)."""
    names = [counter_name(namespace_id) for namespace_id in namespace_ids]
    if names:
        executor.execute(
            delete(Counter)
            .where(Counter.name.in_(names))
            .execution_options(synchronize_session=False)
        )
