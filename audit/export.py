"""Streaming exports of the log: JSON Lines (verifiable), CEF and OCSF (for SIEMs).

An export never holds more than one page of records in memory: it walks each chain by seq
(keyset paging, ``seq > cursor ORDER BY seq LIMIT page_size``), and when given a session factory
rather than a session it opens a short transaction per page, so a long export neither pins a
read snapshot nor holds a connection while the consumer is slow.

**Which records.** ``tenant="acme"`` exports the chains of that name (``tenant:acme`` and each
incarnation's ``tenant:acme@<id>``), ``chain=`` one chain only (what the admin API gives a
tenant-admin: its own incarnation's); ``tenant=None`` exports every chain (the system chain and
all tenants), in chain-id order. A time range
``since <= time < until`` is mapped to one *contiguous* run of seqs per chain -- from the first
record at or after ``since`` to the last record before ``until``, or to the chain's head when
there is no ``until`` -- so the exported run always
links up; a record inside that run whose own time lies outside the range (a caller-supplied
time) is included rather than punching a hole in the chain.

**JSON Lines layout** (what ``verify_export`` expects), per chain in chain-id order::

    purge statement                           only when a retention purge cut the chain at `first`
    record seq=first ... record seq=last      hash-chained (see canonical.py)
      with every stored checkpoint of the chain in [first, last] and the chain's latest
      anchored checkpoint right after its record, ordered by (time_us, signature); stored
      checkpoints past the chain's head (export without `until`) after the last record
    checkpoint                                signed now: head = record `last`, count = records,
                                              and the block's edges (format 2, ``edges.py``)
    ...next chain...
    export trailer                            signed now: tenant, since/until, and per chain
                                              its seq, count, head_hash and checkpoint lines

The per-export checkpoint means a file cut short at the end, or missing records at the start,
fails verification; the trailer does the same for whole chains and for the file as a whole.
Its edges say why the block starts and ends where it does (the record just outside a ``since``
or ``until`` window, or the chain's head), so records deleted from the database at a window's
edge or at a chain's tail are refused before anything is signed (``edges.py``).
The set of chains and their ranges are fixed when the export starts (and signed then); records
appended later are not included. Purging concurrently with an export can remove records the
export still has to read; the result then fails verification rather than silently omitting them.
"""

from __future__ import annotations

import contextlib
import heapq
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import ColumnElement, and_, func, or_, select
from sqlalchemy.orm import Session

from .canonical import SIGNATURE_FIELD, canonical_json, sealed_line
from .events import is_chain_of
from .formats import cef_line, ocsf_line
from .models import AuditChainHead, AuditCheckpointRow, AuditRecordRow
from .records import (
    AuditRecord,
    Checkpoint,
    Edges,
    ExportCheckpoint,
    PurgeStatement,
    checkpoint_body,
    export_checkpoint_body,
    export_trailer_body,
)
from .signing import Signer

ExportFormat = Literal["jsonl", "cef", "ocsf"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("jsonl", "cef", "ocsf")
DEFAULT_PAGE_SIZE = 500

SessionSource = Session | Callable[[], AbstractContextManager[Session]]
"""An open session (the export runs inside it), or a factory such as ``Database.read``."""


@dataclass(frozen=True)
class ChainRange:
    """The contiguous run of one chain an export covers, fixed when the export starts."""

    chain: str
    first: int
    last: int
    head_hash: str
    stored_checkpoints: int
    edges: Edges | None = None
    """What the block proves about its edges (``edges.py``); None only for SIEM exports."""

    @property
    def count(self) -> int:
        return self.last - self.first + 1


@contextlib.contextmanager
def use_session(source: SessionSource) -> Iterator[Session]:
    """The given session, or a fresh one from the factory for the duration of the block."""
    if isinstance(source, Session):
        yield source
    else:
        with source() as session:
            yield session


def export_chains(session: Session, tenant: str | None, chain: str | None) -> list[str]:
    """The chains an export of ``tenant`` (or of ``chain`` alone) covers, in chain-id order."""
    if chain is not None:
        return [chain]
    # Sorted here, not in SQL: the order must be code-point order on every database collation.
    every = sorted(session.scalars(select(AuditChainHead.chain)))
    if tenant is None:
        return every
    return [each for each in every if is_chain_of(each, tenant)]  # every incarnation's


def chain_ranges(
    session: Session,
    tenant: str | None,
    since_us: int | None,
    until_us: int | None,
    only: str | None = None,
) -> list[ChainRange]:
    """The run of each chain in scope (``only`` that chain, if given) that an export from
    ``since`` to ``until`` covers."""
    ranges: list[ChainRange] = []
    for chain in export_chains(session, tenant, only):
        first_query = select(func.min(AuditRecordRow.seq)).where(AuditRecordRow.chain == chain)
        last_query = select(func.max(AuditRecordRow.seq)).where(AuditRecordRow.chain == chain)
        if since_us is not None:
            first_query = first_query.where(AuditRecordRow.time_us >= since_us)
        if until_us is not None:
            last_query = last_query.where(AuditRecordRow.time_us < until_us)
        first = session.scalar(first_query)
        last = session.scalar(last_query)
        if first is None or last is None or first > last:
            continue
        head_hash = session.scalar(
            select(AuditRecordRow.hash).where(
                AuditRecordRow.chain == chain, AuditRecordRow.seq == last
            )
        )
        stored = stored_checkpoints(session, chain, first, last)
        assert head_hash is not None, f"record {last} of {chain} vanished while reading it"
        ranges.append(ChainRange(chain, int(first), int(last), str(head_hash), stored))
    return ranges


def stored_checkpoints(session: Session, chain: str, first: int, last: int) -> int:
    """How many stored checkpoints of ``chain`` fall in seqs ``first..last``: they travel with
    an export of that run."""
    count = session.scalar(
        select(func.count())
        .select_from(AuditCheckpointRow)
        .where(
            AuditCheckpointRow.chain == chain,
            AuditCheckpointRow.seq >= first,
            AuditCheckpointRow.seq <= last,
        )
    )
    return int(count or 0)


_RECORD_COLUMNS = (
    AuditRecordRow.chain,
    AuditRecordRow.seq,
    AuditRecordRow.time_us,
    AuditRecordRow.actor,
    AuditRecordRow.role,
    AuditRecordRow.tenant,
    AuditRecordRow.action,
    AuditRecordRow.target,
    AuditRecordRow.outcome,
    AuditRecordRow.request_id,
    AuditRecordRow.details,
    AuditRecordRow.prev_hash,
    AuditRecordRow.hash,
    AuditRecordRow.mac,
)


def paged_records(
    source: SessionSource, chain: str, first: int, last: int, page_size: int
) -> Iterator[AuditRecord]:
    """Records ``first..last`` of ``chain`` in seq order, one page in memory at a time."""
    cursor = first - 1
    while cursor < last:
        with use_session(source) as session:
            rows = session.execute(
                select(*_RECORD_COLUMNS)
                .where(
                    AuditRecordRow.chain == chain,
                    AuditRecordRow.seq > cursor,
                    AuditRecordRow.seq <= last,
                )
                .order_by(AuditRecordRow.seq)
                .limit(page_size)
            ).all()
        if not rows:
            return
        for row in rows:
            yield _record_of(row)
        cursor = int(rows[-1].seq)


def read_record(session: Session, chain: str, seq: int) -> AuditRecord | None:
    """Record ``seq`` of ``chain`` as stored (hash and MAC unchecked), or None."""
    row = session.execute(
        select(*_RECORD_COLUMNS).where(AuditRecordRow.chain == chain, AuditRecordRow.seq == seq)
    ).one_or_none()
    return None if row is None else _record_of(row)


def _record_of(row: Any) -> AuditRecord:
    """The record in a row of ``_RECORD_COLUMNS`` (typed loosely: its Row type spells out all
    fourteen columns)."""
    return AuditRecord(
        chain=row.chain,
        seq=int(row.seq),
        time_us=int(row.time_us),
        actor=row.actor,
        role=row.role,
        tenant=row.tenant,
        action=row.action,
        target=row.target,
        outcome=row.outcome,
        request_id=row.request_id,
        details=json.loads(row.details),
        prev_hash=row.prev_hash,
        hash=row.hash,
        mac=row.mac,
    )


def _after(key: tuple[int, int, bytes, int]) -> ColumnElement[bool]:
    """Rows strictly after ``key`` in (seq, time_us, signature, id) order, portably."""
    seq, time_us, signature, row_id = key
    table = AuditCheckpointRow
    return or_(
        table.seq > seq,
        and_(table.seq == seq, table.time_us > time_us),
        and_(table.seq == seq, table.time_us == time_us, table.signature > signature),
        and_(
            table.seq == seq,
            table.time_us == time_us,
            table.signature == signature,
            table.id > row_id,
        ),
    )


def paged_checkpoints(
    source: SessionSource, chain: str, first: int, last: int, page_size: int
) -> Iterator[Checkpoint]:
    """Stored checkpoints of ``chain`` at seqs ``first..last`` in (seq, time, signature) order.

    That order is part of the export format: the verifier checks it, so checkpoint lines cannot
    be shuffled unnoticed.
    """
    after: tuple[int, int, bytes, int] | None = None
    table = AuditCheckpointRow
    while True:
        query = select(
            table.id,
            table.seq,
            table.head_hash,
            table.count,
            table.time_us,
            table.key_id,
            table.signature,
        ).where(table.chain == chain, table.seq >= first, table.seq <= last)
        if after is not None:
            query = query.where(_after(after))
        query = query.order_by(table.seq, table.time_us, table.signature, table.id)
        with use_session(source) as session:
            rows = session.execute(query.limit(page_size)).all()
        for _row_id, seq, head_hash, count, time_us, key_id, signature in rows:
            yield Checkpoint(
                chain=chain,
                seq=int(seq),
                head_hash=str(head_hash),
                count=int(count),  # positional: a Row's .count is tuple.count
                time_us=int(time_us),
                key_id=str(key_id),
                signature=bytes(signature),
            )
        if len(rows) < page_size:
            return
        tail = rows[-1]
        after = (int(tail[1]), int(tail[4]), bytes(tail[6]), int(tail[0]))


def sign_checkpoint(
    signer: Signer, *, chain: str, seq: int, head_hash: str, count: int, time_us: int
) -> Checkpoint:
    body = checkpoint_body(
        chain=chain,
        seq=seq,
        head_hash=head_hash,
        count=count,
        time_us=time_us,
        key_id=signer.key_id,
    )
    return Checkpoint(
        chain=chain,
        seq=seq,
        head_hash=head_hash,
        count=count,
        time_us=time_us,
        key_id=signer.key_id,
        signature=signer.sign(canonical_json(body)),
    )


def sign_export_checkpoint(
    signer: Signer, chain_range: ChainRange, edges: Edges, *, time_us: int
) -> ExportCheckpoint:
    """The checkpoint an export signs for one chain block, with the block's proven edges."""
    fields: dict[str, Any] = {
        "chain": chain_range.chain,
        "seq": chain_range.last,
        "head_hash": chain_range.head_hash,
        "count": chain_range.count,
        "time_us": time_us,
        "key_id": signer.key_id,
    }
    body = export_checkpoint_body(**fields, edges=edges)
    return ExportCheckpoint(**fields, edges=edges, signature=signer.sign(canonical_json(body)))


@dataclass(frozen=True)
class ChainEvidence:
    """What the log adds to one chain block beyond the database's records and checkpoints.

    ``purge``: the chain's signed purge statement, written before the block's first record when
    the block starts where the purge cut. ``checkpoints``: signed checkpoints that are not stored
    checkpoints inside the block's range -- the latest anchored one, and any stored past the
    chain's head (left there when records were deleted and the head rewound) -- merged into the
    block in checkpoint order; one past the last record lands after it, where the verifier
    reports that records are missing. ``check``: called with every record before it is written
    (the MAC check), raising to abort the export.
    """

    purge: PurgeStatement | None = None
    checkpoints: tuple[Checkpoint, ...] = ()
    check: Callable[[AuditRecord], None] | None = None


def _checkpoint_order(checkpoint: Checkpoint) -> tuple[int, int, bytes]:
    return (checkpoint.seq, checkpoint.time_us, checkpoint.signature)


def jsonl_lines(
    source: SessionSource,
    ranges: list[ChainRange],
    signer: Signer,
    *,
    tenant: str | None,
    since_us: int | None,
    until_us: int | None,
    now_us: int,
    page_size: int,
    evidence: Mapping[str, ChainEvidence] | None = None,
) -> Iterator[str]:
    """The verifiable export (see the module docstring for its layout)."""
    evidence = evidence or {}
    none = ChainEvidence()
    finals = []
    for r in ranges:
        assert r.edges is not None, f"the edges of {r.chain} were not proven before signing"
        finals.append(sign_export_checkpoint(signer, r, r.edges, time_us=now_us))
    trailer = export_trailer_body(
        tenant=tenant,
        since_us=since_us,
        until_us=until_us,
        time_us=now_us,
        key_id=signer.key_id,
        chains=[
            {
                "chain": r.chain,
                "checkpoints": r.stored_checkpoints
                + len(evidence.get(r.chain, none).checkpoints)
                + 1,
                "count": r.count,
                "head_hash": r.head_hash,
                "seq": r.last,
            }
            for r in ranges
        ],
    )
    trailer_line = sealed_line(trailer, SIGNATURE_FIELD, signer.sign(canonical_json(trailer)).hex())
    for chain_range, final in zip(ranges, finals, strict=True):
        extra = evidence.get(chain_range.chain, none)
        stored = heapq.merge(
            paged_checkpoints(
                source, chain_range.chain, chain_range.first, chain_range.last, page_size
            ),
            sorted(extra.checkpoints, key=_checkpoint_order),
            key=_checkpoint_order,
        )
        pending = next(stored, None)
        if extra.purge is not None and extra.purge.first_seq == chain_range.first:
            yield extra.purge.to_jsonl()
        for record in paged_records(
            source, chain_range.chain, chain_range.first, chain_range.last, page_size
        ):
            if extra.check is not None:
                extra.check(record)
            yield record.to_jsonl()
            while pending is not None and pending.seq <= record.seq:
                yield pending.to_jsonl()
                pending = next(stored, None)
        while pending is not None:  # only if records vanished mid-export; verify will say so
            yield pending.to_jsonl()
            pending = next(stored, None)
        yield final.to_jsonl()
    yield trailer_line


def siem_lines(
    source: SessionSource, ranges: list[ChainRange], fmt: ExportFormat, page_size: int
) -> Iterator[str]:
    """CEF or OCSF lines, one per record, in the same order as the JSONL export."""
    to_line = cef_line if fmt == "cef" else ocsf_line
    for chain_range in ranges:
        for record in paged_records(
            source, chain_range.chain, chain_range.first, chain_range.last, page_size
        ):
            yield to_line(record)
