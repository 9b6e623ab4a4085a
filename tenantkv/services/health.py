"""Readiness of a cache: can it serve? The three things a node needs, each checked for real.

- **index**: the index answers a read (the same question ``/healthz`` asked before: the schema
  table, nothing of any tenant);
- **schema**: the index is at the revision this tenantkv was built for (an index upgraded by a
  newer tenantkv, or one a ``tenantkv db upgrade`` has not reached yet, is not ready);
- **block_store**: a probe extent can be written, committed, read back and deleted, so a full
  disk, a read-only mount or an unreachable Redis shows here before a store degrades.

Load balancers and orchestrators ask this (``/readyz`` of the admin server and the gateway,
``kv.health()`` for servers that embed the cache). Nothing in a report names a tenant, a key or
a driver's message (which can hold a URL with a password): each failed check says what failed in
words of its own, and the cause is logged for the operator.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from ..components.context import CacheContext
from ..index.migrate import current_revision, head_revision
from ..storage import StorageError

logger = logging.getLogger("tenantkv")

#: What the probe writes: a few random bytes, so that no two probes (on several nodes sharing
#: one store) look alike and a stale copy cannot pass for a fresh read.
_PROBE_BYTES = 64


@dataclass(frozen=True)
class HealthReport:
    """The answer of :func:`check_health`: ``ready`` when every check passed, and one line per
    check (``"ok"`` or what failed)."""

    checks: dict[str, str] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return all(state == "ok" for state in self.checks.values())

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"status": "ready" | "unavailable", "checks": {...}}``."""
        return {"status": "ready" if self.ready else "unavailable", "checks": dict(self.checks)}


def check_health(ctx: CacheContext) -> HealthReport:
    """Run the three checks; never raises for what it checks (a failure is a line of the
    report). Each check runs even when an earlier one failed, so the report shows every
    broken part at once."""
    checks: dict[str, str] = {}
    try:
        state = current_revision(ctx.index)
    except SQLAlchemyError as err:
        logger.warning("health: the index does not answer: %s", err)
        checks["index"] = "unreachable"
        checks["schema"] = "unknown (the index does not answer)"
    else:
        checks["index"] = "ok"
        head = head_revision()
        if state.revision == head:
            checks["schema"] = "ok"
        else:
            checks["schema"] = (
                f"the index {state.describe()}, this tenantkv needs {head!r} "
                "(run tenantkv db upgrade)"
            )
    checks["block_store"] = _probe_store(ctx)
    return HealthReport(checks)


def _probe_store(ctx: CacheContext) -> str:
    """Write, commit, read back and delete a small extent; ``"ok"`` or what failed."""
    payload = secrets.token_bytes(_PROBE_BYTES)
    extent_id: str | None = None
    try:
        with ctx.blocks.create() as writer:
            writer.write(payload)
            extent_id = writer.commit(retain_for=60.0)
        with ctx.blocks.open(extent_id) as reader:
            back = bytearray(len(payload))
            reader.readinto(0, [back])
        if bytes(back) != payload:
            return "a probe extent read back different bytes"
    except (StorageError, OSError) as err:
        logger.warning("health: the block store failed a write probe: %s", err)
        return "not writable"
    finally:
        if extent_id is not None:
            try:
                ctx.blocks.delete(extent_id)
            except (StorageError, OSError) as err:  # GC sweeps it as an orphan
                logger.warning("health: deleting the probe extent failed: %s", err)
    return "ok"
