"""The audit log: append in the caller's transaction, checkpoint, export, purge.

:class:`AuditLog` holds no connection and no state but its signing-key cache: every method takes
the caller's SQLAlchemy session, so a record commits or rolls back together with the action it
records, and the cache decides what runs in which transaction.

Appending to a chain locks the chain's head row (``SELECT ... FOR UPDATE`` on PostgreSQL; on
SQLite the caller's write transaction is ``BEGIN IMMEDIATE``, which already holds the database's
write lock), reads the last seq and hash, inserts record ``seq + 1`` linked to that hash and moves
the head. Two nodes appending to one chain therefore queue on the head row and the chain stays
gapless; if they somehow did not, the (chain, seq) primary key would refuse the second record
rather than let the chain fork.

**Retention.** :meth:`purge_expired` removes, per chain, the oldest run of records whose time is
before ``now - retention_seconds`` (one year by default, independent of the cache's own
retention). It only ever cuts a chain's *prefix*, so what remains still links up: an export then
starts at a record whose ``prev_hash`` names a purged record; the verifier takes that
``prev_hash`` as the chain's anchor (reporting that the chain does not start at genesis), and the
checkpoint signed for the export pins the run's head and its length, so nothing at either end can
be cut unnoticed. A record with an old caller-supplied time that sits after newer records is kept
until everything before it has expired. Each purge is itself recorded on the system chain
(``audit.purge``, with the first seq each chain kept), so the gap is explained by the log.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, insert, select, update
from sqlalchemy.orm import Session

from tenantkv.crypto import KeyWrapper

from .canonical import GENESIS_HASH, canonical_json, record_body, sha256_hex, to_microseconds
from .canonical import normalise_details as _normalise_details
from .errors import AuditChainError, AuditRequestError
from .events import (
    AUDIT_PURGE,
    ROLE_SYSTEM,
    SYSTEM_CHAIN,
    TENANT_CHAIN_PREFIX,
    AuditEvent,
    check_tenant,
    is_chain_of,
)
from .export import (
    DEFAULT_PAGE_SIZE,
    EXPORT_FORMATS,
    ExportFormat,
    SessionSource,
    chain_ranges,
    jsonl_lines,
    siem_lines,
    sign_checkpoint,
    use_session,
)
from .models import AuditChainHead, AuditCheckpointRow, AuditRecordRow
from .records import AuditRecord, Checkpoint
from .signing import SigningKeys, insert_ignoring_duplicates
from .signing import public_key_pem as _public_key_pem

DEFAULT_RETENTION_SECONDS = 365 * 86400
PURGE_ACTOR = "tenantkv"


class AuditLog:
    """Tamper-evident, per-tenant hash chains with signed checkpoints and exports.

    ``wrapper`` wraps the checkpoint signing key (the cache passes its master key); ``clock``
    stamps records, checkpoints and purges (inject a fake one in tests).
    """

    def __init__(
        self,
        wrapper: KeyWrapper,
        clock: Callable[[], float] = time.time,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
    ) -> None:
        if (
            isinstance(retention_seconds, bool)
            or not isinstance(retention_seconds, int | float)
            or not math.isfinite(retention_seconds)
            or retention_seconds <= 0
        ):
            raise AuditRequestError("retention_seconds must be a positive number of seconds")
        self.clock = clock
        self.retention_seconds = float(retention_seconds)
        self._keys = SigningKeys(wrapper, clock)

    # ---- appending ----------------------------------------------------------------------------

    def append(self, session: Session, event: AuditEvent) -> AuditRecord:
        """Add ``event`` to its chain inside ``session``'s open transaction; never commits.

        Call it in the same write transaction as the action it records, so both commit or
        neither does. The head row stays locked until that transaction ends.
        """
        if not isinstance(event, AuditEvent):
            raise AuditRequestError(f"append takes an AuditEvent, not {type(event).__name__}")
        chain = event.chain
        time_us = to_microseconds(event.time if event.time is not None else self.clock())
        details = _normalise_details(event.details)
        last_seq, last_hash = self._lock_head(session, chain)
        seq = last_seq + 1
        fields: dict[str, Any] = {
            "chain": chain,
            "seq": seq,
            "time_us": time_us,
            "actor": event.actor,
            "role": event.role,
            "tenant": event.tenant,
            "action": event.action,
            "target": event.target,
            "outcome": event.outcome,
            "request_id": event.request_id,
            "prev_hash": last_hash,
        }
        digest = sha256_hex(canonical_json(record_body(**fields, details=details)))
        session.execute(
            insert(AuditRecordRow).values(
                **fields, details=canonical_json(details).decode("utf-8"), hash=digest
            )
        )
        session.execute(
            update(AuditChainHead)
            .where(AuditChainHead.chain == chain)
            .values(last_seq=seq, last_hash=digest)
            .execution_options(synchronize_session=False)
        )
        return AuditRecord(**fields, details=details, hash=digest)

    @staticmethod
    def _lock_head(session: Session, chain: str) -> tuple[int, str]:
        """Lock the chain's head row (creating it at genesis) and return (last seq, last hash)."""
        query = (
            select(AuditChainHead.last_seq, AuditChainHead.last_hash)
            .where(AuditChainHead.chain == chain)
            .with_for_update()
        )
        row = session.execute(query).one_or_none()
        if row is None:
            session.execute(
                insert_ignoring_duplicates(session, AuditChainHead).values(
                    chain=chain, last_seq=0, last_hash=GENESIS_HASH
                )
            )
            row = session.execute(query).one()
        return int(row[0]), str(row[1])

    # ---- signing ------------------------------------------------------------------------------

    def ensure_signing_key(self, session: Session) -> str:
        """Create the signing key if there is none (a write); return its key id.

        The cache calls this once at open in a write transaction, so later exports and
        ``public_key_pem`` calls never have to write.
        """
        return self._keys.signer(session).key_id

    def public_key_pem(self, session: Session) -> bytes:
        """The checkpoint verification key (SubjectPublicKeyInfo PEM), for ``audit verify``."""
        return _public_key_pem(self._keys.signer(session).public_key)

    def checkpoint(self, session: Session, chain: str) -> Checkpoint:
        """Sign and store the current head of ``chain`` (a write, in the caller's transaction).

        Stored checkpoints are carried by every later JSONL export that covers their seq, so a
        rewrite of the chain after a checkpoint was signed is detected even if it recomputed
        every hash. Publishing checkpoints outside the database (or keeping earlier exports)
        extends that to someone who can also delete checkpoint rows.
        """
        row = session.execute(
            select(AuditChainHead.last_seq, AuditChainHead.last_hash)
            .where(AuditChainHead.chain == chain)
            .with_for_update()
        ).one_or_none()
        if row is None or int(row[0]) == 0:
            raise AuditChainError(f"chain {chain!r} has no records to checkpoint")
        seq, head_hash = int(row[0]), str(row[1])
        first = session.scalar(
            select(func.min(AuditRecordRow.seq)).where(AuditRecordRow.chain == chain)
        )
        count = 0 if first is None else seq - int(first) + 1
        stored = session.scalar(
            select(AuditRecordRow.hash).where(
                AuditRecordRow.chain == chain, AuditRecordRow.seq == seq
            )
        )
        if stored is not None and stored != head_hash:
            raise AuditChainError(
                f"chain {chain!r}: head says record {seq} hashes to {head_hash}, "
                f"the record says {stored}"
            )
        checkpoint = sign_checkpoint(
            self._keys.signer(session),
            chain=chain,
            seq=seq,
            head_hash=head_hash,
            count=count,
            time_us=to_microseconds(self.clock()),
        )
        session.execute(
            insert(AuditCheckpointRow).values(
                chain=checkpoint.chain,
                seq=checkpoint.seq,
                head_hash=checkpoint.head_hash,
                count=checkpoint.count,
                time_us=checkpoint.time_us,
                key_id=checkpoint.key_id,
                signature=checkpoint.signature,
            )
        )
        return checkpoint

    # ---- exporting ----------------------------------------------------------------------------

    def export(
        self,
        source: SessionSource,
        *,
        tenant: str | None,
        since: float | None = None,
        until: float | None = None,
        fmt: ExportFormat = "jsonl",
        page_size: int = DEFAULT_PAGE_SIZE,
        chain: str | None = None,
    ) -> Iterator[str]:
        """Stream an export as lines without trailing newlines (see ``export.py``).

        ``source`` is an open session or a session factory such as ``Database.read`` (one
        short transaction per page). ``tenant=None`` exports every chain, ``tenant="acme"`` every
        chain of that name (each incarnation's), ``chain`` only that chain (of ``tenant`` if
        given); ``since``/``until``
        (seconds since the epoch) bound record times as ``since <= time < until``. Arguments are
        checked now; the database is read lazily as lines are consumed. JSONL needs the signing
        key: it is created on first use, which writes, so call :meth:`ensure_signing_key` first
        when exporting through read-only sessions.
        """
        if fmt not in EXPORT_FORMATS:
            raise AuditRequestError(f"export format {fmt!r} must be one of {EXPORT_FORMATS}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise AuditRequestError("page_size must be a positive integer")
        if tenant is not None:
            check_tenant(tenant)
        if chain is not None and (
            (tenant is not None and not is_chain_of(chain, tenant))
            or not (chain == SYSTEM_CHAIN or chain.startswith(TENANT_CHAIN_PREFIX))
        ):
            raise AuditRequestError(f"{chain!r} is not a chain (of tenant {tenant!r})")
        since_us = None if since is None else to_microseconds(since)
        until_us = None if until is None else to_microseconds(until)
        if since_us is not None and until_us is not None and since_us >= until_us:
            raise AuditRequestError("since must be before until")
        return self._export(source, tenant, since_us, until_us, fmt, page_size, chain)

    def _export(
        self,
        source: SessionSource,
        tenant: str | None,
        since_us: int | None,
        until_us: int | None,
        fmt: ExportFormat,
        page_size: int,
        chain: str | None = None,
    ) -> Iterator[str]:
        with use_session(source) as session:
            ranges = chain_ranges(session, tenant, since_us, until_us, chain)
            signer = self._keys.signer(session) if fmt == "jsonl" else None
        if signer is None:
            yield from siem_lines(source, ranges, fmt, page_size)
            return
        yield from jsonl_lines(
            source,
            ranges,
            signer,
            tenant=tenant,
            since_us=since_us,
            until_us=until_us,
            now_us=to_microseconds(self.clock()),
            page_size=page_size,
        )

    # ---- retention ----------------------------------------------------------------------------

    def purge_expired(self, session: Session) -> int:
        """Delete records older than the retention period; return how many went.

        Runs in the caller's write transaction and records itself on the system chain.
        """
        cutoff_us = to_microseconds(max(0.0, self.clock() - self.retention_seconds))
        by_chain = select(AuditRecordRow.chain, func.min(AuditRecordRow.seq)).group_by(
            AuditRecordRow.chain
        )
        oldest = {str(c): int(seq) for c, seq in session.execute(by_chain)}
        fresh = {
            str(c): int(seq)
            for c, seq in session.execute(by_chain.where(AuditRecordRow.time_us >= cutoff_us))
        }
        heads = {
            str(c): int(seq)
            for c, seq in session.execute(select(AuditChainHead.chain, AuditChainHead.last_seq))
        }
        removed = 0
        kept_from: dict[str, int] = {}
        for chain in sorted(oldest):
            keep_from = fresh.get(chain, heads.get(chain, 0) + 1)
            if oldest[chain] >= keep_from:
                continue
            result = cast(
                CursorResult[Any],
                session.execute(
                    delete(AuditRecordRow)
                    .where(AuditRecordRow.chain == chain, AuditRecordRow.seq < keep_from)
                    .execution_options(synchronize_session=False)
                ),
            )
            session.execute(
                delete(AuditCheckpointRow)
                .where(AuditCheckpointRow.chain == chain, AuditCheckpointRow.seq < keep_from)
                .execution_options(synchronize_session=False)
            )
            removed += max(0, result.rowcount)
            kept_from[chain] = keep_from
        if removed:
            self.append(
                session,
                AuditEvent(
                    actor=PURGE_ACTOR,
                    role=ROLE_SYSTEM,
                    tenant=None,
                    action=AUDIT_PURGE,
                    target="records",
                    details={
                        "records": removed,
                        "before_us": cutoff_us,
                        "kept_from_seq": kept_from,
                    },
                ),
            )
        return removed
