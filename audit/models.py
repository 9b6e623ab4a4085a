"""Tables of the audit log, on their own declarative base.

``AuditBase.metadata`` is separate from the cache's index so ``tenantkv.audit`` never imports the
cache; the cache creates both (``AuditBase.metadata.create_all(engine)`` next to its own) in the
same database, so an audit record commits in the same transaction as the action it records.

* ``tkv_audit_records`` -- the records, keyed by (chain, seq). Append-only except for
  :meth:`AuditLog.purge_expired`, which removes the oldest records of a chain.
* ``tkv_audit_heads`` -- one row per chain: the last seq and hash. Appends lock this row
  (``SELECT ... FOR UPDATE`` on PostgreSQL; SQLite write transactions are ``BEGIN IMMEDIATE``
  already), so concurrent appenders to one chain queue up instead of forking it; the
  (chain, seq) primary key of the records is the second line of defence.
* ``tkv_audit_checkpoints`` -- signed statements "chain C had head H at seq S, covering N records".
* ``tkv_audit_signing_keys`` -- the Ed25519 checkpoint key: the private half wrapped by the master
  key (never in clear), the public half in clear so anyone may fetch it.
* ``tkv_audit_purges`` -- per purged chain, the signed statement of the latest retention purge
  (first kept seq and the hash it links to), which exports carry and verifiers require.

Records and heads carry MACs under a key derived from the master key (``macs.py``). An index
created before they existed lacks those columns: the cache's schema migrations add them
(``tenantkv db upgrade``, which calls ``AuditLog.seal_upgraded``), and the rows already there
count as pre-MAC.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Index, Integer, LargeBinary, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from .events import MAX_ACTION, MAX_ACTOR, MAX_REQUEST_ID, MAX_ROLE, MAX_TARGET, MAX_TENANT

MAX_CHAIN = 160


class AuditBase(DeclarativeBase):
    """Declarative base of the audit tables (its own ``metadata``)."""


class AuditRecordRow(AuditBase):
    """One hash-chained record; ``details`` is its canonical JSON text."""

    __tablename__ = "tkv_audit_records"
    __table_args__ = (Index("ix_tkv_audit_records_chain_time", "chain", "time_us"),)

    chain: Mapped[str] = mapped_column(String(MAX_CHAIN), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    time_us: Mapped[int] = mapped_column(BigInteger)
    actor: Mapped[str] = mapped_column(String(MAX_ACTOR))
    role: Mapped[str] = mapped_column(String(MAX_ROLE))
    tenant: Mapped[str | None] = mapped_column(String(MAX_TENANT))
    action: Mapped[str] = mapped_column(String(MAX_ACTION))
    target: Mapped[str] = mapped_column(String(MAX_TARGET))
    outcome: Mapped[str] = mapped_column(String(16))
    request_id: Mapped[str | None] = mapped_column(String(MAX_REQUEST_ID))
    details: Mapped[str] = mapped_column(Text)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))
    #: HMAC under the audit MAC key (``macs.record_mac``); None only for pre-MAC records.
    mac: Mapped[str | None] = mapped_column(String(64), nullable=True)


class AuditChainHead(AuditBase):
    """The tip of one chain; the row appends lock to serialise themselves."""

    __tablename__ = "tkv_audit_heads"

    chain: Mapped[str] = mapped_column(String(MAX_CHAIN), primary_key=True)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    last_hash: Mapped[str] = mapped_column(String(64))
    #: HMAC of the head (``macs.head_mac``); None only for a head created in this transaction.
    mac: Mapped[str | None] = mapped_column(String(64), nullable=True)
    #: The first seq of the chain that carries a record MAC (earlier ones are pre-MAC).
    mac_from_seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class AuditCheckpointRow(AuditBase):
    """A signed checkpoint of a chain (see ``records.Checkpoint`` for what is signed)."""

    __tablename__ = "tkv_audit_checkpoints"
    __table_args__ = (Index("ix_tkv_audit_checkpoints_chain_seq", "chain", "seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    chain: Mapped[str] = mapped_column(String(MAX_CHAIN))
    seq: Mapped[int] = mapped_column(BigInteger)
    head_hash: Mapped[str] = mapped_column(String(64))
    count: Mapped[int] = mapped_column(BigInteger)
    time_us: Mapped[int] = mapped_column(BigInteger)
    key_id: Mapped[str] = mapped_column(String(64))
    signature: Mapped[bytes] = mapped_column(LargeBinary(64))


class AuditSigningKey(AuditBase):
    """The checkpoint signing key; ``name`` is ``"default"`` (room for rotation later)."""

    __tablename__ = "tkv_audit_signing_keys"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(64), unique=True)
    algorithm: Mapped[str] = mapped_column(String(16))
    public_key: Mapped[bytes] = mapped_column(LargeBinary(32))
    wrapped_private_key: Mapped[bytes] = mapped_column(LargeBinary)
    created_at_us: Mapped[int] = mapped_column(BigInteger)


class AuditPurgeRow(AuditBase):
    """The signed statement of a chain's latest retention purge (``records.PurgeStatement``)."""

    __tablename__ = "tkv_audit_purges"

    chain: Mapped[str] = mapped_column(String(MAX_CHAIN), primary_key=True)
    first_seq: Mapped[int] = mapped_column(BigInteger)
    prev_hash: Mapped[str] = mapped_column(String(64))
    time_us: Mapped[int] = mapped_column(BigInteger)
    key_id: Mapped[str] = mapped_column(String(64))
    signature: Mapped[bytes] = mapped_column(LargeBinary(64))
