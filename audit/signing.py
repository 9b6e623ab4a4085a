"""The Ed25519 key that signs checkpoints, kept wrapped by the master key.

The private key exists in clear only in process memory. In the database
(``tkv_audit_signing_keys``) it is ``KeyWrapper.wrap(raw 32-byte private key,
SIGNING_KEY_CONTEXT)``; the raw 32-byte public key sits beside it in clear. ``key_id`` is the
first 16 bytes of SHA-256(raw public key), in hex: checkpoints name it so a verifier holding
several public keys knows which one applies.

The key is created on first use. Two nodes doing that at once both try to insert the row under
the fixed name ``"default"`` with ON CONFLICT DO NOTHING and then read back whichever won, so a
cache never has two live signing keys. A loaded key is cross-checked against its stored public
half: a row whose public key was swapped fails loudly instead of signing under a key nobody holds.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from sqlalchemy import insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from tenantkv.crypto import KeyWrapper, SealOpenError

from .canonical import to_microseconds
from .errors import AuditSigningKeyError
from .macs import derive_mac_key
from .models import AuditSigningKey

SIGNING_KEY_CONTEXT = b"tenantkv/audit-signing\x00"
SIGNING_KEY_NAME = "default"
ALGORITHM = "ed25519"


def key_id_of(public_raw: bytes) -> str:
    """The identifier checkpoints carry for the key that signed them."""
    return hashlib.sha256(public_raw).digest()[:16].hex()


def public_raw_of(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def insert_ignoring_duplicates(session: Session, entity: Any) -> Any:
    """An INSERT that does nothing when the primary key exists (concurrent first use)."""
    dialect = session.get_bind().dialect.name
    if dialect == "sqlite":
        return sqlite.insert(entity).on_conflict_do_nothing()
    if dialect == "postgresql":
        return postgresql.insert(entity).on_conflict_do_nothing()
    return insert(entity)  # other dialects: a racing second insert fails instead of forking


@dataclass(frozen=True)
class Signer:
    """An unwrapped signing key, ready to sign checkpoint bytes."""

    key_id: str
    private_key: Ed25519PrivateKey
    public_raw: bytes
    #: The audit MAC key derived from this private key (``macs.py``).
    mac_key: bytes

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()


class SigningKeys:
    """Loads (creating on first use) and caches the log's signing key."""

    def __init__(self, wrapper: KeyWrapper, clock: Callable[[], float]) -> None:
        self._wrapper = wrapper
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: Signer | None = None

    def signer(self, session: Session) -> Signer:
        """The signing key, created in ``session``'s transaction if there is none yet.

        Creating writes a row, so the first call should come in a write transaction (the cache
        does it once at open, through :meth:`AuditLog.ensure_signing_key`).
        """
        row = self._load_row(session)
        if row is None:
            self._create(session)
            row = self._load_row(session)
            if row is None:  # pragma: no cover - the insert above or a racing one left a row
                raise AuditSigningKeyError("the audit signing key could not be created")
        key_id, public_raw, wrapped = row
        with self._lock:
            cached = self._cached
        if cached is not None and cached.public_raw == public_raw:
            return cached
        signer = self._unwrap(key_id, public_raw, wrapped)
        with self._lock:
            self._cached = signer
        return signer

    @staticmethod
    def _load_row(session: Session) -> tuple[str, bytes, bytes] | None:
        row = session.execute(
            select(
                AuditSigningKey.key_id,
                AuditSigningKey.public_key,
                AuditSigningKey.wrapped_private_key,
            ).where(AuditSigningKey.name == SIGNING_KEY_NAME)
        ).one_or_none()
        if row is None:
            return None
        return str(row[0]), bytes(row[1]), bytes(row[2])

    def _create(self, session: Session) -> None:
        private_key = Ed25519PrivateKey.generate()
        raw = private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        public_raw = public_raw_of(private_key.public_key())
        session.execute(
            insert_ignoring_duplicates(session, AuditSigningKey).values(
                name=SIGNING_KEY_NAME,
                key_id=key_id_of(public_raw),
                algorithm=ALGORITHM,
                public_key=public_raw,
                wrapped_private_key=self._wrapper.wrap(raw, SIGNING_KEY_CONTEXT),
                created_at_us=to_microseconds(self._clock()),
            )
        )

    def _unwrap(self, key_id: str, public_raw: bytes, wrapped: bytes) -> Signer:
        try:
            raw = self._wrapper.unwrap(wrapped, SIGNING_KEY_CONTEXT)
        except SealOpenError:
            raise AuditSigningKeyError(
                "the audit signing key does not open with this master key"
            ) from None
        try:
            private_key = Ed25519PrivateKey.from_private_bytes(raw)
        except ValueError:
            raise AuditSigningKeyError("the audit signing key is not an Ed25519 key") from None
        if public_raw_of(private_key.public_key()) != public_raw or key_id_of(public_raw) != key_id:
            raise AuditSigningKeyError(
                "the stored public audit key does not match its private key (row altered?)"
            )
        return Signer(
            key_id=key_id,
            private_key=private_key,
            public_raw=public_raw,
            mac_key=derive_mac_key(raw),
        )


def public_key_pem(public_key: Ed25519PublicKey) -> bytes:
    """SubjectPublicKeyInfo PEM, the form ``audit verify --public-key`` reads."""
    return public_key.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
