"""The audit log: append in the caller's transaction, checkpoint, export, purge, anchor.

:class:`AuditLog` holds no connection and no state but its signing-key cache: every method takes
the caller's SQLAlchemy session, so a record commits or rolls back together with the action it
records, and the cache decides what runs in which transaction.

Appending to a chain locks the chain's head row (``SELECT ... FOR UPDATE`` on PostgreSQL; on
SQLite the caller's write transaction is ``BEGIN IMMEDIATE``, which already holds the database's
write lock), reads the last seq and hash, inserts record ``seq + 1`` linked to that hash and moves
the head. Two nodes appending to one chain therefore queue on the head row and the chain stays
gapless; if they somehow did not, the (chain, seq) primary key would refuse the second record
rather than let the chain fork.

**Integrity.** Records and heads carry MACs keyed from the master key, and committed heads are
anchored in a file outside the database; every signing step checks them first (``macs.py``,
``anchors.py``, ``integrity.py``, docs/audit.md).

**Retention.** :meth:`purge_expired` removes, per chain, the oldest run of records whose time is
before ``now - retention_seconds`` (one year by default, independent of the cache's own
retention). It only ever cuts a chain's *prefix*, so what remains still links up: an export then
starts at a record whose ``prev_hash`` names a purged record; a signed purge statement (first
kept seq, that ``prev_hash``), stored per chain and carried by the export, is what lets the
verifier accept that start, and the checkpoint signed for the export pins the run's head and its
length, so nothing at either end can be cut unnoticed. A record with an old caller-supplied time
that sits after newer records is kept until everything before it has expired. Each purge is
itself recorded on the system chain (``audit.purge``, with the first seq each chain kept), so the
gap is explained by the log.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, insert, select, update
from sqlalchemy.orm import Session

from tenantkv.crypto import KeyWrapper

from .anchors import AnchorFile
from .canonical import GENESIS_HASH, canonical_json, record_body, sha256_hex, to_microseconds
from .canonical import normalise_details as _normalise_details
from .edges import proven_range
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
    ChainEvidence,
    ChainRange,
    ExportFormat,
    SessionSource,
    chain_ranges,
    export_chains,
    jsonl_lines,
    paged_checkpoints,
    siem_lines,
    sign_checkpoint,
    use_session,
)
from .integrity import (
    Head,
    check_anchor,
    first_seqs,
    last_seqs,
    new_anchors,
    read_head,
    read_heads,
    read_purges,
    sign_purge,
    store_purge,
)
from .macs import check_record, head_mac, record_mac
from .models import AuditChainHead, AuditCheckpointRow, AuditRecordRow
from .records import AuditRecord, Checkpoint
from .signing import Signer, SigningKeys, insert_ignoring_duplicates
from .signing import public_key_pem as _public_key_pem

DEFAULT_RETENTION_SECONDS = 365 * 86400
_NO_SEQ = 2**62  # above every seq: "to the end of the chain"
PURGE_ACTOR = "tenantkv"


class AuditLog:
    """Tamper-evident, per-tenant hash chains with signed checkpoints and exports.

    ``wrapper`` wraps the checkpoint signing key (the cache passes its master key); ``clock``
    stamps records, checkpoints and purges (inject a fake one in tests). ``anchor_path`` is the
    anchor file (``anchors.py``) outside the database; None keeps no anchors (then a chain
    rewound to an older head copied with its MAC goes unnoticed: see ``docs/audit.md``).
    """

    def __init__(
        self,
        wrapper: KeyWrapper,
        clock: Callable[[], float] = time.time,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
        anchor_path: Path | None = None,
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
        self.anchors = None if anchor_path is None else AnchorFile(anchor_path)

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
        signer = self._keys.signer(session)
        head = self._lock_head(session, chain, signer)
        last_seq, last_hash = head.last_seq, head.last_hash
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
        mac = record_mac(signer.mac_key, chain=chain, seq=seq, digest=digest)
        mac_from_seq = head.mac_from_seq if head.mac_from_seq is not None else 1
        session.execute(
            insert(AuditRecordRow).values(
                **fields, details=canonical_json(details).decode("utf-8"), hash=digest, mac=mac
            )
        )
        session.execute(
            update(AuditChainHead)
            .where(AuditChainHead.chain == chain)
            .values(
                last_seq=seq,
                last_hash=digest,
                mac=head_mac(
                    signer.mac_key,
                    chain=chain,
                    last_seq=seq,
                    last_hash=digest,
                    mac_from_seq=mac_from_seq,
                ),
            )
            .execution_options(synchronize_session=False)
        )
        return AuditRecord(**fields, details=details, hash=digest, mac=mac)

    @staticmethod
    def _lock_head(session: Session, chain: str, signer: Signer) -> Head:
        """Lock the chain's head row (creating it at genesis) and return it, its MAC checked.

        A head that fails its MAC is never extended: its next MAC would vouch for the
        tampered state, so the append (and the action it records) fails instead.
        """
        head = read_head(session, chain, lock=True)
        if head is None:
            session.execute(
                insert_ignoring_duplicates(session, AuditChainHead).values(
                    chain=chain,
                    last_seq=0,
                    last_hash=GENESIS_HASH,
                    mac_from_seq=1,
                    mac=head_mac(
                        signer.mac_key,
                        chain=chain,
                        last_seq=0,
                        last_hash=GENESIS_HASH,
                        mac_from_seq=1,
                    ),
                )
            )
            head = read_head(session, chain, lock=True)
            assert head is not None, "the head row inserted above is gone"
        head.check(signer)
        return head

    # ---- signing ------------------------------------------------------------------------------

    def prepare(self, session: Session) -> str:
        """At open, in a write transaction: create the signing key if there is none yet; return
        its id. Upgrading an older index's tables is no longer done here but by the index's
        migrations (``tenantkv db upgrade``), which call :meth:`seal_upgraded`."""
        return self._keys.signer(session).key_id

    def seal_upgraded(self, session: Session) -> bool:
        """Seal an index whose MAC columns were just added (by its migration); True if sealed.

        Its chain heads are MACed as they stand (their records stay pre-MAC, ``macs.py``) and
        each chain already cut by retention gets a signed purge statement for where it now
        starts. Trusting the database once, at the upgrade, is the best an index without MACs
        allows (docs/audit.md).

        With anchors, this node ran with MACs before: columns missing now were dropped, and
        sealing would launder whatever was done meanwhile. Then nothing is sealed, the heads stay
        without MACs, and every check reports them.
        """
        signer = self._keys.signer(session)
        if self._has_anchors():
            return False
        self._seal_legacy(session, signer)
        return True

    def _has_anchors(self) -> bool:
        """Whether this node has anchored anything (only a version with MACs does)."""
        if self.anchors is None:
            return False
        try:
            return self.anchors.path.stat().st_size > 0
        except FileNotFoundError:
            return False

    def _seal_legacy(self, session: Session, signer: Signer) -> None:
        heads = read_heads(session)
        firsts = first_seqs(session, heads)
        purges = read_purges(session, heads)
        now_us = to_microseconds(self.clock())
        for head in heads.values():
            mac_from_seq = head.last_seq + 1
            session.execute(
                update(AuditChainHead)
                .where(AuditChainHead.chain == head.chain)
                .values(
                    mac_from_seq=mac_from_seq,
                    mac=head_mac(
                        signer.mac_key,
                        chain=head.chain,
                        last_seq=head.last_seq,
                        last_hash=head.last_hash,
                        mac_from_seq=mac_from_seq,
                    ),
                )
                .execution_options(synchronize_session=False)
            )
            first = firsts.get(head.chain, head.last_seq + 1)
            if first > 1 and head.chain not in purges:
                sealed = dataclasses.replace(head, mac_from_seq=mac_from_seq)
                self._sign_purge(session, signer, sealed, first, now_us)

    def _sign_purge(
        self, session: Session, signer: Signer, head: Head, first: int, now_us: int
    ) -> None:
        """Store the signed statement that ``head.chain`` now starts at ``first``."""
        if first > head.last_seq:  # every record purged: the next one links to the head
            prev_hash = head.last_hash
        else:
            row = session.execute(
                select(AuditRecordRow.prev_hash, AuditRecordRow.hash, AuditRecordRow.mac).where(
                    AuditRecordRow.chain == head.chain, AuditRecordRow.seq == first
                )
            ).one()
            check_record(
                signer.mac_key,
                chain=head.chain,
                seq=first,
                digest=str(row[1]),
                mac=row[2],
                mac_from_seq=head.mac_from_seq or 1,
            )
            prev_hash = str(row[0])
        store_purge(
            session,
            sign_purge(
                signer, chain=head.chain, first_seq=first, prev_hash=prev_hash, time_us=now_us
            ),
        )

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
        signer = self._keys.signer(session)
        head = read_head(session, chain, lock=True)
        if head is None or head.last_seq == 0:
            raise AuditChainError(f"chain {chain!r} has no records to checkpoint")
        head.check(signer)
        seq, head_hash = head.last_seq, head.last_hash
        first = session.scalar(
            select(func.min(AuditRecordRow.seq)).where(AuditRecordRow.chain == chain)
        )
        count = 0 if first is None else seq - int(first) + 1
        stored = session.execute(
            select(AuditRecordRow.hash, AuditRecordRow.mac).where(
                AuditRecordRow.chain == chain, AuditRecordRow.seq == seq
            )
        ).one_or_none()
        if stored is not None:
            if stored[0] != head_hash:
                raise AuditChainError(
                    f"chain {chain!r}: head says record {seq} hashes to {head_hash}, "
                    f"the record says {stored[0]}"
                )
            check_record(
                signer.mac_key,
                chain=chain,
                seq=seq,
                digest=head_hash,
                mac=stored[1],
                mac_from_seq=head.mac_from_seq or 1,
            )
        checkpoint = sign_checkpoint(
            signer,
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
        checked now; the database is read lazily as lines are consumed. A JSONL export raises
        :class:`AuditChainError` (at the first line, or at a record) when the database fails the
        integrity checks (MACs, anchors: docs/audit.md). JSONL needs the signing
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
        if fmt != "jsonl":
            with use_session(source) as session:
                ranges = chain_ranges(session, tenant, since_us, until_us, chain)
            yield from siem_lines(source, ranges, fmt, page_size)
            return
        with use_session(source) as session:
            signer = self._keys.signer(session)
            ranges, evidence = self._evidence(
                session,
                signer,
                export_chains(session, tenant, chain),
                since_us=since_us,
                until_us=until_us,
                every_chain=tenant is None
                and chain is None
                and since_us is None
                and until_us is None,
                page_size=page_size,
            )
        if not isinstance(source, Session):  # fresh transactions: only committed heads
            self.anchor(source, chains=[r.chain for r in ranges])
        yield from jsonl_lines(
            source,
            ranges,
            signer,
            tenant=tenant,
            since_us=since_us,
            until_us=until_us,
            now_us=to_microseconds(self.clock()),
            page_size=page_size,
            evidence=evidence,
        )

    def _evidence(
        self,
        session: Session,
        signer: Signer,
        chains: list[str],
        *,
        since_us: int | None,
        until_us: int | None,
        every_chain: bool,
        page_size: int,
    ) -> tuple[list[ChainRange], dict[str, ChainEvidence]]:
        """Check the chains an export covers (raising :class:`AuditChainError`), prove each
        block's edges (``edges.py``), and gather what the export carries beyond their records:
        purge statements, the latest anchored checkpoints, stored checkpoints past the chain's
        head, and the record MAC check."""
        anchored = {} if self.anchors is None else self.anchors.latest(signer)
        scope = set(chains) | (set(anchored) if every_chain else set())
        # Stored checkpoints past each chain's last record, read *before* the heads: one that a
        # concurrent append and checkpoint committed meanwhile is then at or below the head read
        # next, and is left out; one above the head can only mean records were removed.
        tails: dict[str, list[Checkpoint]] = {}
        if until_us is None:
            lasts = last_seqs(session, chains)
            tails = {
                c: list(paged_checkpoints(session, c, lasts.get(c, 0) + 1, _NO_SEQ, page_size))
                for c in chains
            }
        heads = read_heads(session, scope)
        purges = read_purges(session, scope)
        holding = last_seqs(session, [c for c in chains if c not in heads])
        for chain in sorted(scope):
            head = heads.get(chain)
            if head is not None:
                head.check(signer)
            elif chain in holding:
                raise AuditChainError(f"chain {chain!r} has records but no head (deleted)")
            if chain in anchored:
                check_anchor(session, head, anchored[chain], purges.get(chain))
        ranges: list[ChainRange] = []
        evidence: dict[str, ChainEvidence] = {}
        for chain in chains:
            head = heads.get(chain)
            if head is None:
                continue
            r = proven_range(session, signer, head, purges.get(chain), since_us, until_us)
            if r is None:
                continue
            extra: list[Checkpoint] = []
            anchor = anchored.get(chain)
            if anchor is not None and r.first <= anchor.seq <= r.last:
                extra.append(anchor)
            extra += [c for c in tails.get(chain, []) if c.seq > head.last_seq]
            ranges.append(r)
            evidence[chain] = ChainEvidence(
                purge=purges.get(chain),
                checkpoints=tuple(extra),
                check=_mac_check(signer, head),
            )
        return ranges, evidence

    def anchor(self, source: SessionSource, chains: list[str] | None = None) -> list[Checkpoint]:
        """Append a signed checkpoint of every chain (or of ``chains``) whose head moved to the
        anchor file.

        Checks first that those heads carry their MACs and that no chain is behind, or differs
        from, its latest anchor (raising :class:`AuditChainError`, appending nothing); with
        ``chains=None`` that includes anchored chains that vanished. An export anchors only the
        chains it covers, so one tenant's export neither fails nor names another's chain. Give
        it a session factory, or a session whose transaction has committed what it reads: an
        anchored head that is then rolled back would look like a truncation forever after.
        Without an anchor file it does nothing. Returns the checkpoints appended.
        """
        if self.anchors is None:
            return []
        with use_session(source) as session:
            signer = self._keys.signer(session)
            anchored = self.anchors.latest(signer)
            if chains is not None:
                anchored = {c: anchored[c] for c in chains if c in anchored}
            heads = read_heads(session, chains)
            purges = read_purges(session, anchored)
            for head in heads.values():
                head.check(signer)
            for chain, checkpoint in sorted(anchored.items()):
                check_anchor(session, heads.get(chain), checkpoint, purges.get(chain))
            fresh = new_anchors(session, signer, heads, anchored, to_microseconds(self.clock()))
        self.anchors.append(fresh)
        return fresh

    # ---- retention ----------------------------------------------------------------------------

    def purge_expired(self, session: Session) -> int:
        """Delete records older than the retention period; return how many went.

        Runs in the caller's write transaction and records itself on the system chain. Each
        chain it cuts gets a signed purge statement (where it now starts, and the hash its
        first record links to), which exports carry and ``verify_export`` requires.
        """
        signer = self._keys.signer(session)
        now_us = to_microseconds(self.clock())
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
            head = read_head(session, chain, lock=True)
            if head is None:
                raise AuditChainError(f"chain {chain!r} has records but no head (deleted)")
            head.check(signer)
            self._sign_purge(session, signer, head, keep_from, now_us)
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


def _mac_check(signer: Signer, head: Head) -> Callable[[AuditRecord], None]:
    """The per-record MAC check an export runs before writing each record."""
    mac_from_seq = head.mac_from_seq if head.mac_from_seq is not None else 1

    def check(record: AuditRecord) -> None:
        check_record(
            signer.mac_key,
            chain=record.chain,
            seq=record.seq,
            digest=record.hash,
            mac=record.mac,
            mac_from_seq=mac_from_seq,
        )

    return check
