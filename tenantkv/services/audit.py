"""The audit log as the edges use it: records of their own, exports, signed checkpoints and the
verification key, over one open cache's components (``kv.audit``).

The log itself (chains, MACs, signatures, export formats) is the ``tenantkv.audit`` package;
what it leaves to its users is which transaction each call runs in and which chain a tenant's
name means now. Those choices are security properties, so they are made here once rather than
by each router and command: a checkpoint request is recorded on the chain it checkpoints, in the
checkpoint's own transaction (so the checkpoint covers its own record); an export is recorded
before it streams; a chain named by tenant is that tenant's current incarnation's, and a tenant
that does not exist starts no chain.

Records of state changes are not written here: each service writes its own in the change's
transaction (``services/tenants.py``, ``services/tokens.py``). :meth:`AuditService.record` is for
events that accompany no change (refusals, exports).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

from ..audit import (
    AUDIT_EXPORT,
    SYSTEM_CHAIN,
    Attribution,
    AuditEvent,
    Checkpoint,
    ExportFormat,
)
from ..components.context import CacheContext
from ..index import audit_queries
from ..index import tenants as tenant_rows
from ..index.audit_chains import incarnation_chain
from ..index.failures import typed_failures

AUDIT_CHECKPOINT: Final = "audit.checkpoint"
MAX_CHECKPOINTS: Final = 1000


@typed_failures
class AuditService:
    """Audit reads and records for the admin API and the CLI."""

    def __init__(self, ctx: CacheContext) -> None:
        self._ctx = ctx

    def record(self, *events: AuditEvent) -> None:
        """Append ``events`` in one write transaction of their own (all or none)."""
        with self._ctx.index.write() as session:
            for event in events:
                self._ctx.audit.append(session, event)

    def current_chain(self, tenant: str) -> str | None:
        """The chain of the tenant named ``tenant`` as it exists now (None: no such tenant)."""
        with self._ctx.index.read() as session:
            return incarnation_chain(session, tenant)

    def export(
        self,
        *,
        tenant: str | None,
        since: float | None = None,
        until: float | None = None,
        fmt: ExportFormat = "jsonl",
        chain: str | None = None,
    ) -> Iterator[str]:
        """Lines of an export (see ``AuditLog.export``): the arguments are checked now, the
        index is read lazily, one short read transaction per page, as the lines are taken."""
        return self._ctx.audit.export(
            self._ctx.index.read, tenant=tenant, since=since, until=until, fmt=fmt, chain=chain
        )

    def record_export(
        self, by: Attribution, *, tenant: str | None, target: str, details: Mapping[str, Any]
    ) -> None:
        """Record an export before it runs, making sure the signing key exists (an export's
        read transactions never write it). An export of a tenant that no longer exists (its
        past chains) is recorded on the system chain: filing it under the name would start a
        chain for no tenant."""
        with self._ctx.index.write() as session:
            self._ctx.audit.ensure_signing_key(session)
            exists = tenant is not None and tenant_rows.id_of(session, tenant) is not None
            self._ctx.audit.append(
                session, by.event(tenant if exists else None, AUDIT_EXPORT, target, details=details)
            )

    def checkpoints(self, chain: str, limit: int = MAX_CHECKPOINTS) -> list[Checkpoint]:
        """Stored signed checkpoints of ``chain``, oldest first (at most ``limit``)."""
        with self._ctx.index.read() as session:
            return [
                Checkpoint(
                    chain=row.chain,
                    seq=row.seq,
                    head_hash=row.head_hash,
                    count=row.count,
                    time_us=row.time_us,
                    key_id=row.key_id,
                    signature=row.signature,
                )
                for row in audit_queries.checkpoints(session, chain, limit=limit)
            ]

    def checkpoint(self, tenant: str | None, by: Attribution) -> Checkpoint | None:
        """Sign the current head of ``tenant``'s current chain (None: the system chain) now.

        The request is recorded on that chain first, in the same transaction, so the
        checkpoint covers its own audit record. None, with nothing written, when there is no
        such tenant: no chain is started for it."""
        with self._ctx.index.write() as session:
            chain = SYSTEM_CHAIN if tenant is None else incarnation_chain(session, tenant)
            if chain is None:
                return None
            record = self._ctx.audit.append(session, by.event(tenant, AUDIT_CHECKPOINT, chain))
            assert record.chain == chain, f"{chain} checkpoint request filed in {record.chain}"
            return self._ctx.audit.checkpoint(session, chain)

    def public_key_pem(self, *, create: bool = False) -> bytes:
        """The Ed25519 checkpoint verification key (PEM). Opening the cache made it; with
        ``create`` the read runs in a write transaction, which makes the key if it is somehow
        missing (the CLI's ``audit public-key``)."""
        transaction = self._ctx.index.write if create else self._ctx.index.read
        with transaction() as session:
            return self._ctx.audit.public_key_pem(session)
