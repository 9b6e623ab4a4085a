"""MACs that tie the audit tables to the master key: a row the database alone can write fails them.

A hash chain proves that records link up, not who wrote them: anyone who can write the tables can
rewrite a record and re-hash everything after it, or rewind a chain's head. So every record and
every chain head also carries an HMAC-SHA256 under the **audit MAC key**, which is derived with
HKDF-SHA256 (``info = MAC_KEY_INFO``) from the Ed25519 checkpoint signing key. That key is stored
only wrapped by the master key (``signing.py``), so the MAC key is as secret as the master key and
needs no storage of its own; replacing the signing-key row (the only way to get another MAC key)
makes every existing MAC fail.

What is MACed (canonical JSON, ``canonical.py``):

* a record: ``{"chain","hash","seq","type":"record-mac"}`` -- its hash covers every field, so the
  MAC covers the whole record and pins it to its place;
* a chain head: ``{"chain","last_hash","last_seq","mac_from_seq","type":"head-mac"}``.
  ``mac_from_seq`` is the first seq that must carry a MAC: 1 for a chain created with MACs, the
  next seq for a chain that existed before MACs were added (its older records are "pre-MAC" and
  are protected by the chain hashes up to the MACed head only).

The MACs never leave the database: the cache checks them before it signs anything (checkpoints,
exports, anchors), and refuses with :class:`AuditChainError` when one fails. Offline verifiers
keep relying on signatures.
"""

from __future__ import annotations

import hashlib
import hmac

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .canonical import canonical_json
from .errors import AuditChainError

MAC_KEY_INFO = b"tenantkv/audit-mac\x00"


def derive_mac_key(signing_private_raw: bytes) -> bytes:
    """The audit MAC key of a signing key (32 bytes)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=MAC_KEY_INFO).derive(
        signing_private_raw
    )


def _mac(key: bytes, body: dict[str, object]) -> str:
    return hmac.new(key, canonical_json(body), hashlib.sha256).hexdigest()


def record_mac(key: bytes, *, chain: str, seq: int, digest: str) -> str:
    """The MAC stored beside record ``seq`` of ``chain`` whose hash is ``digest``."""
    return _mac(key, {"chain": chain, "hash": digest, "seq": seq, "type": "record-mac"})


def head_mac(key: bytes, *, chain: str, last_seq: int, last_hash: str, mac_from_seq: int) -> str:
    """The MAC of a chain head row."""
    return _mac(
        key,
        {
            "chain": chain,
            "last_hash": last_hash,
            "last_seq": last_seq,
            "mac_from_seq": mac_from_seq,
            "type": "head-mac",
        },
    )


def check_head(
    key: bytes,
    *,
    chain: str,
    last_seq: int,
    last_hash: str,
    mac: str | None,
    mac_from_seq: int | None,
) -> None:
    """Raise :class:`AuditChainError` unless the head row is one the cache wrote.

    Every head is created with a MAC (even at seq 0), so a head without one was altered.
    """
    if mac is None or mac_from_seq is None:
        raise AuditChainError(
            f"chain {chain!r}: its head carries no MAC (altered in the database; the cache "
            "writes one with every record)"
        )
    expected = head_mac(
        key, chain=chain, last_seq=last_seq, last_hash=last_hash, mac_from_seq=mac_from_seq
    )
    if not hmac.compare_digest(expected, mac):
        raise AuditChainError(
            f"chain {chain!r}: its head (seq {last_seq}) fails its MAC: it was written without "
            "the master key (rewound or rewritten in the database)"
        )


def check_record(
    key: bytes, *, chain: str, seq: int, digest: str, mac: str | None, mac_from_seq: int
) -> None:
    """Raise :class:`AuditChainError` unless record ``seq`` is one the cache wrote."""
    if seq < mac_from_seq:
        return  # pre-MAC record: covered by the chain hashes up to the MACed head
    if mac is None or not hmac.compare_digest(
        record_mac(key, chain=chain, seq=seq, digest=digest), mac
    ):
        raise AuditChainError(
            f"chain {chain!r}: record {seq} fails its MAC: it was written or re-hashed in the "
            "database without the master key"
        )
