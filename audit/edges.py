"""Where each chain block of a JSONL export starts and ends, proven from the database.

A window ``since <= time < until`` maps to one contiguous run of seqs per chain (``export.py``).
Someone who can write the index but lacks the master key cannot forge a record, but can delete
a run of them: one that ends where an ``until`` window ends (or starts where a ``since`` window
starts) used to leave that export verifying -- it simply ended (or started) at the next record
left -- and only an unbounded export showed the gap. Likewise an export without ``until`` ended
at the last record left, so deleting the records appended since the last anchor, head row
untouched (its MAC still holds), went unnoticed. So before an export signs a block, it proves
both edges of it here:

* **start**: seq 1 (genesis); or the first record a signed purge statement names (retention cut
  the chain there); or, in a ``since`` export, record ``first - 1`` exists, is genuine (its hash
  recomputed from its columns, its MAC checked) and is older than ``since``;
* **end**: the chain's head -- record ``head.last_seq`` exists and hashes to the MAC-checked
  head -- which every export without ``until`` must reach; or, in an ``until`` export, record
  ``last + 1`` exists, is genuine and is not older than ``until``.

Anything else raises :class:`AuditChainError`: the exporter refuses rather than sign the gap
away. The facts go into the block's export checkpoint (``records.Edges``), which ``verify.py``
checks against the block and the trailer's bounds. A head whose chain holds no record at all is
refused too, unless a signed purge statement says retention removed every one.

The edge records are re-hashed from their columns because a record's MAC covers its seq and
hash, not its time: a ``time_us`` column changed alone would otherwise move a record out of a
window with its MAC intact. (Records inside the block need no such care: the verifier re-hashes
every one.) What an edge cannot show: a record with a caller-supplied time older than ``since``
that sits after newer records hides the deletion of records before it from a ``since`` export
-- only the run up to the edge record is proven; an unbounded export still shows the gap.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from .canonical import canonical_json, legacy_text, sha256_hex
from .errors import AuditChainError
from .export import ChainRange, read_record, stored_checkpoints
from .integrity import Head
from .macs import check_record
from .models import AuditRecordRow
from .records import AuditRecord, EdgeRecord, Edges, PurgeStatement
from .signing import Signer


def proven_range(
    session: Session,
    signer: Signer,
    head: Head,
    purge: PurgeStatement | None,
    since_us: int | None,
    until_us: int | None,
) -> ChainRange | None:
    """The block of ``head.chain`` an export from ``since`` to ``until`` covers, with its edges
    proven; None when the window holds none of its records. ``head`` must be MAC-checked.

    Only records up to the head count, so records appended after the head was read (by a
    concurrent writer) are neither exported nor mistaken for the record after the window.
    """
    chain = head.chain
    if head.last_seq == 0:
        return None
    in_chain = (AuditRecordRow.chain == chain, AuditRecordRow.seq <= head.last_seq)
    oldest = session.scalar(select(func.min(AuditRecordRow.seq)).where(*in_chain))
    if oldest is None:
        if purge is not None and purge.first_seq > head.last_seq:
            return None  # retention removed every record; the next one links to the head
        raise AuditChainError(
            f"chain {chain!r}: its head is at seq {head.last_seq} but it holds no records "
            "(deleted from the database)"
        )
    first = int(oldest)
    if since_us is not None:
        found = session.scalar(
            select(func.min(AuditRecordRow.seq)).where(
                *in_chain, AuditRecordRow.time_us >= since_us
            )
        )
        if found is None:
            return None
        first = int(found)
    last = head.last_seq
    if until_us is not None:
        found = session.scalar(
            select(func.max(AuditRecordRow.seq)).where(*in_chain, AuditRecordRow.time_us < until_us)
        )
        if found is None:
            return None
        last = int(found)
    if first > last:
        return None
    before = _before(session, signer, head, purge, first, since_us)
    if last == head.last_seq:
        tip = _genuine(session, signer, head, last, "at the chain's head")
        if tip.hash != head.last_hash:
            raise AuditChainError(
                f"chain {chain!r}: record {last} hashes to {tip.hash}, its head says "
                f"{head.last_hash}"
            )
        after = None
    else:
        assert until_us is not None, "only an until window ends before the head"
        tip = _genuine(session, signer, head, last, "the last one in the export's window")
        next_record = _genuine(
            session, signer, head, last + 1, f"the one after the export's window (seq {last})"
        )
        if next_record.time_us < until_us or next_record.prev_hash != tip.hash:
            raise AuditChainError(
                f"chain {chain!r}: record {last + 1} does not close the export's until window "
                "(the records changed while the export started)"
            )
        after = _edge(next_record)
    return ChainRange(
        chain,
        first,
        last,
        tip.hash,
        stored_checkpoints(session, chain, first, last),
        Edges(before=before, after=after, head_seq=head.last_seq),
    )


def _before(
    session: Session,
    signer: Signer,
    head: Head,
    purge: PurgeStatement | None,
    first: int,
    since_us: int | None,
) -> EdgeRecord | None:
    """The record before a ``since`` block, or None where genesis, a purge statement or the
    lack of a ``since`` bound explains the start (the verifier checks those on its own)."""
    if since_us is None or first == 1 or (purge is not None and purge.first_seq == first):
        return None
    previous = _genuine(
        session, signer, head, first - 1, f"the one before the export's window (seq {first})"
    )
    if previous.time_us >= since_us:
        raise AuditChainError(
            f"chain {head.chain!r}: record {first - 1} does not close the export's since window "
            "(the records changed while the export started)"
        )
    return _edge(previous)


def _genuine(session: Session, signer: Signer, head: Head, seq: int, role: str) -> AuditRecord:
    """Record ``seq`` of the head's chain, refused unless the cache wrote it as it stands."""
    chain = head.chain
    record = read_record(session, chain, seq)
    if record is None:
        raise AuditChainError(
            f"chain {chain!r}: record {seq}, {role}, is missing: deleted from the database "
            f"(the chain's head is at seq {head.last_seq})"
        )
    text = canonical_json(record.body()).decode("utf-8")
    legacy = legacy_text(text)
    if sha256_hex(text.encode("utf-8")) != record.hash and (
        legacy is None or sha256_hex(legacy.encode("utf-8")) != record.hash
    ):
        raise AuditChainError(
            f"chain {chain!r}: record {seq} does not hash to its stored hash (edited in the "
            "database)"
        )
    check_record(
        signer.mac_key,
        chain=chain,
        seq=seq,
        digest=record.hash,
        mac=record.mac,
        mac_from_seq=head.mac_from_seq if head.mac_from_seq is not None else 1,
    )
    return record


def _edge(record: AuditRecord) -> EdgeRecord:
    return EdgeRecord(
        seq=record.seq, hash=record.hash, prev_hash=record.prev_hash, time_us=record.time_us
    )
