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
        "v": FORMAT_VERSION,
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
