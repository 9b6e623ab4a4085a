"""What the log hands back: a hash-chained record and a signed checkpoint.

Both are plain frozen values that know their canonical body (``canonical.py``) and their export
line, so the writer, the exporter and the verifier agree on the bytes by construction.

A **checkpoint** signs, with the log's Ed25519 key, the canonical bytes of::

    {"chain":str,"count":int,"head_hash":hex64,"key_id":hex32,"seq":int,"time_us":int,
     "type":"checkpoint","v":1}

meaning: "record ``seq`` of ``chain`` had hash ``head_hash``, and the ``count`` records
``seq - count + 1 .. seq`` were present" at ``time_us``. A stored checkpoint (from
:meth:`AuditLog.checkpoint`) counts the records the chain still held; the checkpoint an export
signs for itself counts the records of the chain in that export, so a verifier can tell a file cut
at either end from a complete one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .canonical import (
    EXPORT_FORMAT_VERSION,
    FORMAT_VERSION,
    HASH_FIELD,
    SIGNATURE_FIELD,
    canonical_json,
    record_body,
    sealed_line,
)


@dataclass(frozen=True)
class AuditRecord:
    """One record of a chain, with the hash that the next record's ``prev_hash`` repeats."""

    chain: str
    seq: int
    time_us: int
    actor: str
    role: str
    tenant: str | None
    action: str
    target: str
    outcome: str
    request_id: str | None
    details: Mapping[str, Any]
    prev_hash: str
    hash: str
    #: The record's MAC as stored (``macs.py``); never exported, None for pre-MAC records.
    mac: str | None = field(default=None, compare=False, repr=False)

    @property
    def time(self) -> float:
        """Seconds since the epoch."""
        return self.time_us / 1_000_000

    def body(self) -> dict[str, Any]:
        """The hashed object (every field but ``hash``)."""
        return record_body(
            chain=self.chain,
            seq=self.seq,
            time_us=self.time_us,
            actor=self.actor,
            role=self.role,
            tenant=self.tenant,
            action=self.action,
            target=self.target,
            outcome=self.outcome,
            request_id=self.request_id,
            details=self.details,
            prev_hash=self.prev_hash,
        )

    def to_jsonl(self) -> str:
        """The record's JSON Lines export line (no trailing newline)."""
        return sealed_line(self.body(), HASH_FIELD, self.hash)


@dataclass(frozen=True)
class Checkpoint:
    """A signed statement of a chain's head (see the module docstring for the signed bytes)."""

    chain: str
    seq: int
    head_hash: str
    count: int
    time_us: int
    key_id: str
    signature: bytes

    @property
    def time(self) -> float:
        return self.time_us / 1_000_000

    @property
    def first_seq(self) -> int:
        """The first seq the checkpoint covers."""
        return self.seq - self.count + 1

    def body(self) -> dict[str, Any]:
        return checkpoint_body(
            chain=self.chain,
            seq=self.seq,
            head_hash=self.head_hash,
            count=self.count,
            time_us=self.time_us,
            key_id=self.key_id,
        )

    def signed_bytes(self) -> bytes:
        """Exactly the bytes the signature covers."""
        return canonical_json(self.body())

    def to_jsonl(self) -> str:
        return sealed_line(self.body(), SIGNATURE_FIELD, self.signature.hex())


def checkpoint_body(
    *, chain: str, seq: int, head_hash: str, count: int, time_us: int, key_id: str
) -> dict[str, Any]:
    return {
        "chain": chain,
        "count": count,
        "head_hash": head_hash,
        "key_id": key_id,
        "seq": seq,
        "time_us": time_us,
        "type": "checkpoint",
        "v": FORMAT_VERSION,
    }


@dataclass(frozen=True)
class EdgeRecord:
    """A record just outside an export's window, named so the export can prove its edges.

    Its ``hash`` is what the window's first record links to (the record before a ``since``
    window) or its ``prev_hash`` is the window's last record's hash (the record after an
    ``until`` window), and its ``time_us`` shows it lies outside the window.
    """

    seq: int
    hash: str
    prev_hash: str
    time_us: int

    def body(self) -> dict[str, Any]:
        return {
            "hash": self.hash,
            "prev_hash": self.prev_hash,
            "seq": self.seq,
            "time_us": self.time_us,
        }


@dataclass(frozen=True)
class Edges:
    """What an export proves about where one chain block starts and ends.

    ``before``: the record just before the block, older than ``since`` (None: the block starts
    at seq 1, or where a signed purge statement says retention cut the chain, or the export has
    no ``since``). ``after``: the record just after the block, not older than ``until`` (None:
    the block ends at the chain's head). ``head_seq``: the head's last seq when the export ran.
    """

    before: EdgeRecord | None
    after: EdgeRecord | None
    head_seq: int


@dataclass(frozen=True)
class ExportCheckpoint:
    """The checkpoint an export signs for each chain block, with the block's edges.

    Signed bytes (canonical JSON, format 2)::

        {"after":edge|null,"before":edge|null,"chain":str,"count":int,"head_hash":hex64,
         "head_seq":int,"key_id":hex32,"seq":int,"time_us":int,"type":"checkpoint","v":2}

    where ``edge`` is ``{"hash":hex64,"prev_hash":hex64,"seq":int,"time_us":int}``. Beyond a
    stored checkpoint's meaning it says: the chain's head was at ``head_seq``; ``before``
    (when given) is the record ``seq - count`` and is older than the export's ``since``;
    ``after`` (when given) is record ``seq + 1`` and is not older than its ``until``; with no
    ``after``, ``seq`` is ``head_seq``. The exporter signs that only after reading those
    records and checking their MACs, so records deleted at either edge of a window, or at the
    chain's tail, are refused rather than signed away.
    """

    chain: str
    seq: int
    head_hash: str
    count: int
    time_us: int
    key_id: str
    edges: Edges
    signature: bytes

    def body(self) -> dict[str, Any]:
        return export_checkpoint_body(
            chain=self.chain,
            seq=self.seq,
            head_hash=self.head_hash,
            count=self.count,
            time_us=self.time_us,
            key_id=self.key_id,
            edges=self.edges,
        )

    def to_jsonl(self) -> str:
        return sealed_line(self.body(), SIGNATURE_FIELD, self.signature.hex())


def export_checkpoint_body(
    *,
    chain: str,
    seq: int,
    head_hash: str,
    count: int,
    time_us: int,
    key_id: str,
    edges: Edges,
) -> dict[str, Any]:
    """A checkpoint body (``checkpoint_body``) with the edges of an export's chain block."""
    body = checkpoint_body(
        chain=chain, seq=seq, head_hash=head_hash, count=count, time_us=time_us, key_id=key_id
    )
    body.update(
        after=None if edges.after is None else edges.after.body(),
        before=None if edges.before is None else edges.before.body(),
        head_seq=edges.head_seq,
        v=EXPORT_FORMAT_VERSION,
    )
    return body


def export_trailer_body(
    *,
    tenant: str | None,
    since_us: int | None,
    until_us: int | None,
    time_us: int,
    key_id: str,
    chains: list[dict[str, Any]],
) -> dict[str, Any]:
    """The signed last line of a JSONL export: what it covers, chain by chain.

    ``chains`` lists, in file order, ``{"chain", "checkpoints", "count", "head_hash", "seq"}`` for
    each chain block, so dropping or duplicating a whole block (or any checkpoint line) shows.
    """
    return {
        "chains": chains,
        "key_id": key_id,
        "since_us": since_us,
        "tenant": tenant,
        "time_us": time_us,
        "type": "export",
        "until_us": until_us,
        "v": EXPORT_FORMAT_VERSION,
    }


@dataclass(frozen=True)
class PurgeStatement:
    """A signed statement that a retention purge cut ``chain`` before ``first_seq``.

    Signed bytes (canonical JSON)::

        {"chain":str,"first_seq":int,"key_id":hex32,"prev_hash":hex64,"time_us":int,
         "type":"purge","v":1}

    meaning: "the records of ``chain`` before ``first_seq`` were removed by retention; record
    ``first_seq`` links to ``prev_hash``". An export whose chain block starts after seq 1 carries
    it right before the block's first record, and the verifier requires it there (unless the
    export's ``since`` bound explains the start), so deleting the oldest records of a chain in
    the database -- without the key that signs this -- no longer verifies.
    """

    chain: str
    first_seq: int
    prev_hash: str
    time_us: int
    key_id: str
    signature: bytes

    def body(self) -> dict[str, Any]:
        return purge_body(
            chain=self.chain,
            first_seq=self.first_seq,
            prev_hash=self.prev_hash,
            time_us=self.time_us,
            key_id=self.key_id,
        )

    def signed_bytes(self) -> bytes:
        """Exactly the bytes the signature covers."""
        return canonical_json(self.body())

    def to_jsonl(self) -> str:
        return sealed_line(self.body(), SIGNATURE_FIELD, self.signature.hex())


def purge_body(
    *, chain: str, first_seq: int, prev_hash: str, time_us: int, key_id: str
) -> dict[str, Any]:
    return {
        "chain": chain,
        "first_seq": first_seq,
        "key_id": key_id,
        "prev_hash": prev_hash,
        "time_us": time_us,
        "type": "purge",
        "v": FORMAT_VERSION,
    }
