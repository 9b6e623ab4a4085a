"""The milestone-1 tables (commit 2e18036), frozen: its index models (then ``tenantkv/models.py``),
audit models and admin token table, copied as they were. The migration tests create these on
either backend, fill them with ``tests/data/milestone1/rows.json`` and upgrade them; they must not
follow today's models, nor read git (CI may clone shallow).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

MAX_ACTOR, MAX_ROLE, MAX_TENANT, MAX_ACTION, MAX_TARGET, MAX_REQUEST_ID = 256, 64, 128, 64, 512, 128
MAX_CHAIN = 160


class Base(DeclarativeBase):
    pass


class SchemaInfo(Base):
    """One row per setting of the index itself (schema version)."""

    __tablename__ = "tkv_schema"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))


class Tenant(Base):
    __tablename__ = "tkv_tenants"

    id: Mapped[bytes] = mapped_column(LargeBinary(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[float]
    updated_at: Mapped[float]
    current_key_version: Mapped[int]
    quota_bytes: Mapped[int] = mapped_column(BigInteger)
    retention: Mapped[str] = mapped_column(String(1024))  # JSON: class name -> seconds


class DataKey(Base):
    """A tenant's data key (DEK) version, wrapped by the master key."""

    __tablename__ = "tkv_data_keys"

    tenant_id: Mapped[bytes] = mapped_column(
        ForeignKey("tkv_tenants.id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(primary_key=True)
    wrapped_key: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[float]


class Namespace(Base):
    """(tenant, scope, model fingerprint) with its own prefix-hashing key."""

    __tablename__ = "tkv_namespaces"
    __table_args__ = (UniqueConstraint("tenant_id", "scope", "fingerprint"),)

    id: Mapped[bytes] = mapped_column(LargeBinary(16), primary_key=True)
    tenant_id: Mapped[bytes] = mapped_column(ForeignKey("tkv_tenants.id", ondelete="CASCADE"))
    scope: Mapped[str] = mapped_column(String(256))  # "" for the tenant-wide scope
    model: Mapped[str] = mapped_column(String(256))
    fingerprint: Mapped[str] = mapped_column(String(64))  # sha256 hex of model + layout
    wrapped_hash_key: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[float]


class Extent(Base):
    """One store call's sealed segments, kept as one object in the block store."""

    __tablename__ = "tkv_extents"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # block-store id
    namespace_id: Mapped[bytes] = mapped_column(
        ForeignKey("tkv_namespaces.id", ondelete="CASCADE"), index=True
    )
    tenant_id: Mapped[bytes] = mapped_column(
        ForeignKey("tkv_tenants.id", ondelete="CASCADE"), index=True
    )
    key_version: Mapped[int]
    kind: Mapped[str] = mapped_column(String(64))  # retention class
    suite: Mapped[int]
    salt: Mapped[bytes] = mapped_column(LargeBinary(16))
    num_blocks: Mapped[int]
    num_layers: Mapped[int]
    segment_bytes: Mapped[int]  # plaintext bytes of one (block, layer) segment
    size_bytes: Mapped[int] = mapped_column(BigInteger)  # bytes the extent takes in the store
    created_at: Mapped[float]
    last_used_at: Mapped[float] = mapped_column(index=True)
    expires_at: Mapped[float] = mapped_column(index=True)


class Usage(Base):
    """Metering counters of one tenant scope in one time bucket (added to, never rewritten)."""

    __tablename__ = "tkv_usage"

    tenant_id: Mapped[bytes] = mapped_column(
        ForeignKey("tkv_tenants.id", ondelete="CASCADE"), primary_key=True
    )
    scope: Mapped[str] = mapped_column(String(256), primary_key=True)
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # start, epoch seconds
    hit_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    miss_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    served_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    stored_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    evicted_extents: Mapped[int] = mapped_column(BigInteger, default=0)
    evicted_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    expired_extents: Mapped[int] = mapped_column(BigInteger, default=0)
    expired_bytes: Mapped[int] = mapped_column(BigInteger, default=0)


class Block(Base):
    """A cached 64-token block of a namespace, found by its keyed prefix hash."""

    __tablename__ = "tkv_blocks"
    __table_args__ = (Index("ix_tkv_blocks_extent", "extent_id"),)

    namespace_id: Mapped[bytes] = mapped_column(
        ForeignKey("tkv_namespaces.id", ondelete="CASCADE"), primary_key=True
    )
    block_key: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)
    extent_id: Mapped[str] = mapped_column(ForeignKey("tkv_extents.id", ondelete="CASCADE"))
    slot: Mapped[int]  # index of the block inside its extent
    position: Mapped[int]  # index of the block inside the prefix (0 = first 64 tokens)
    stored_at: Mapped[float]
    last_used_at: Mapped[float]


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


class AuditChainHead(AuditBase):
    """The tip of one chain; the row appends lock to serialise themselves."""

    __tablename__ = "tkv_audit_heads"

    chain: Mapped[str] = mapped_column(String(MAX_CHAIN), primary_key=True)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    last_hash: Mapped[str] = mapped_column(String(64))


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


class ServerBase(DeclarativeBase):
    pass


class ApiToken(ServerBase):
    __tablename__ = "tkv_api_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # public: names the token
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the token
    role: Mapped[str] = mapped_column(String(32))
    tenant: Mapped[str | None] = mapped_column(String(128), index=True)
    created_at: Mapped[float] = mapped_column(Float)
    created_by: Mapped[str] = mapped_column(String(256))
    expires_at: Mapped[float | None] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float)


#: Every milestone-1 table, in the order they can be created and filled.
METADATA: tuple[MetaData, ...] = (Base.metadata, ServerBase.metadata, AuditBase.metadata)
