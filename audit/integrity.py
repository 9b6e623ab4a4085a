"""What the cache checks before it signs anything: head and record MACs, anchors, purge statements.

The database is not trusted to be only ever written by the cache. Before a checkpoint, an export
or an anchor is signed, the chain heads involved must carry valid MACs (``macs.py``), the records
exported must too, and every chain's state must be at or past its latest anchored checkpoint
(``anchors.py``) and agree with it. Any disagreement raises :class:`AuditChainError`, so nothing
signed ever vouches for rows the database alone could have written.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from .canonical import canonical_json
from .errors import AuditChainError
from .export import sign_checkpoint
from .macs import check_head
from .models import AuditChainHead, AuditPurgeRow, AuditRecordRow
from .records import Checkpoint, PurgeStatement, purge_body
from .signing import Signer


@dataclass(frozen=True)
class Head:
    """A chain's head row as stored."""

    chain: str
    last_seq: int
    last_hash: str
    mac: str | None
    mac_from_seq: int | None

    def check(self, signer: Signer) -> None:
        """Raise :class:`AuditChainError` unless the cache wrote this head."""
        check_head(
            signer.mac_key,
            chain=self.chain,
            last_seq=self.last_seq,
            last_hash=self.last_hash,
            mac=self.mac,
            mac_from_seq=self.mac_from_seq,
        )


_HEAD_COLUMNS = (
    AuditChainHead.chain,
    AuditChainHead.last_seq,
    AuditChainHead.last_hash,
    AuditChainHead.mac,
    AuditChainHead.mac_from_seq,
)


def _head(row: tuple[object, ...]) -> Head:
    chain, last_seq, last_hash, mac, mac_from_seq = row
    return Head(
        chain=str(chain),
        last_seq=int(str(last_seq)),
        last_hash=str(last_hash),
        mac=None if mac is None else str(mac),
        mac_from_seq=None if mac_from_seq is None else int(str(mac_from_seq)),
    )


def read_head(session: Session, chain: str, *, lock: bool = False) -> Head | None:
    """The head of ``chain`` (locked for update when ``lock``), or None if it has none."""
    query = select(*_HEAD_COLUMNS).where(AuditChainHead.chain == chain)
    if lock:
        query = query.with_for_update()
    row = session.execute(query).one_or_none()
    return None if row is None else _head(tuple(row))


def read_heads(session: Session, chains: Iterable[str] | None = None) -> dict[str, Head]:
    """Heads of ``chains`` (every chain when None)."""
    query = select(*_HEAD_COLUMNS)
    if chains is not None:
        wanted = sorted(set(chains))
        if not wanted:
            return {}
        query = query.where(AuditChainHead.chain.in_(wanted))
    return {head.chain: head for head in (_head(tuple(row)) for row in session.execute(query))}


def first_seqs(session: Session, chains: Iterable[str]) -> dict[str, int]:
    """The lowest seq each chain still holds (chains without records are absent)."""
    wanted = sorted(set(chains))
    if not wanted:
        return {}
    rows = session.execute(
        select(AuditRecordRow.chain, func.min(AuditRecordRow.seq))
        .where(AuditRecordRow.chain.in_(wanted))
        .group_by(AuditRecordRow.chain)
    )
    return {str(chain): int(seq) for chain, seq in rows}


def last_seqs(session: Session, chains: Iterable[str]) -> dict[str, int]:
    """The highest seq each chain still holds (chains without records are absent)."""
    wanted = sorted(set(chains))
    if not wanted:
        return {}
    rows = session.execute(
        select(AuditRecordRow.chain, func.max(AuditRecordRow.seq))
        .where(AuditRecordRow.chain.in_(wanted))
        .group_by(AuditRecordRow.chain)
    )
    return {str(chain): int(seq) for chain, seq in rows}


# ---- purge statements --------------------------------------------------------------------------


def sign_purge(
    signer: Signer, *, chain: str, first_seq: int, prev_hash: str, time_us: int
) -> PurgeStatement:
    body = purge_body(
        chain=chain, first_seq=first_seq, prev_hash=prev_hash, time_us=time_us, key_id=signer.key_id
    )
    return PurgeStatement(
        chain=chain,
        first_seq=first_seq,
        prev_hash=prev_hash,
        time_us=time_us,
        key_id=signer.key_id,
        signature=signer.sign(canonical_json(body)),
    )


def store_purge(session: Session, statement: PurgeStatement) -> None:
    """Keep ``statement`` as the chain's latest purge statement (replacing an earlier one)."""
    session.execute(
        delete(AuditPurgeRow)
        .where(AuditPurgeRow.chain == statement.chain)
        .execution_options(synchronize_session=False)
    )
    session.execute(
        insert(AuditPurgeRow).values(
            chain=statement.chain,
            first_seq=statement.first_seq,
            prev_hash=statement.prev_hash,
            time_us=statement.time_us,
            key_id=statement.key_id,
            signature=statement.signature,
        )
    )


def read_purges(session: Session, chains: Iterable[str]) -> dict[str, PurgeStatement]:
    wanted = sorted(set(chains))
    if not wanted:
        return {}
    table = AuditPurgeRow
    rows = session.execute(
        select(
            table.chain,
            table.first_seq,
            table.prev_hash,
            table.time_us,
            table.key_id,
            table.signature,
        ).where(table.chain.in_(wanted))
    )
    return {
        str(chain): PurgeStatement(
            chain=str(chain),
            first_seq=int(first_seq),
            prev_hash=str(prev_hash),
            time_us=int(time_us),
            key_id=str(key_id),
            signature=bytes(signature),
        )
        for chain, first_seq, prev_hash, time_us, key_id, signature in rows
    }


# ---- anchors -----------------------------------------------------------------------------------


def check_anchor(
    session: Session, head: Head | None, anchor: Checkpoint, purge: PurgeStatement | None
) -> None:
    """Raise :class:`AuditChainError` unless the database still holds what ``anchor`` signed.

    The chain must reach the anchored seq, and the record there must still hash to the anchored
    head hash -- unless a retention purge (its signed statement says so) removed it since.
    """
    chain, seq = anchor.chain, anchor.seq
    if head is None:
        raise AuditChainError(
            f"chain {chain!r} was anchored at seq {seq} but the database has no such chain "
            "(deleted)"
        )
    if head.last_seq < seq:
        raise AuditChainError(
            f"chain {chain!r} ends at seq {head.last_seq}, but seq {seq} was anchored: records "
            "were deleted and the head rewound in the database"
        )
    if head.last_seq == seq and head.last_hash != anchor.head_hash:
        raise AuditChainError(f"chain {chain!r}: its head differs from the anchored one at {seq}")
    stored = session.scalar(
        select(AuditRecordRow.hash).where(AuditRecordRow.chain == chain, AuditRecordRow.seq == seq)
    )
    if stored is None:
        if purge is None or purge.first_seq <= seq:
            raise AuditChainError(
                f"chain {chain!r}: record {seq}, anchored outside the database, is missing "
                "and no retention purge removed it"
            )
    elif stored != anchor.head_hash:
        raise AuditChainError(
            f"chain {chain!r}: record {seq} no longer hashes to its anchored hash (rewritten)"
        )


def new_anchors(
    session: Session,
    signer: Signer,
    heads: dict[str, Head],
    anchored: dict[str, Checkpoint],
    time_us: int,
) -> list[Checkpoint]:
    """Signed checkpoints of the heads that moved past their latest anchor."""
    moved = [
        head
        for head in heads.values()
        if head.last_seq > 0
        and (head.chain not in anchored or anchored[head.chain].seq < head.last_seq)
    ]
    firsts = first_seqs(session, [head.chain for head in moved])
    return [
        sign_checkpoint(
            signer,
            chain=head.chain,
            seq=head.last_seq,
            head_hash=head.last_hash,
            count=head.last_seq - firsts.get(head.chain, head.last_seq + 1) + 1,
            time_us=time_us,
        )
        for head in sorted(moved, key=lambda h: h.chain)
    ]
