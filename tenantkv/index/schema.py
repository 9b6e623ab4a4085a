"""SQLAlchemy models of the metadata index.

Nothing here identifies tokens in clear: block rows carry keyed prefix hashes (see ``prefix.py``),
data and namespace keys are stored wrapped by the master key.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, ForeignKey, Index, LargeBinary, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


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
    served_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    stored_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    evicted_extents: Mapped[int] = mapped_column(BigInteger, default=0)
    evicted_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    expired_extents: Mapped[int] = mapped_column(BigInteger, default=0)
    expired_bytes: Mapped[int] = mapped_column(BigInteger, default=0)


class Block(Base):
    """A cached 64-token block of a namespace, found by its keyed prefix hash."""

    __tablename__ = "tkv_blocks"
    # An extent's blocks in slot order, with what a load's plan checks of them (namespace, key):
    # the plan reads the rest of a prefix's run in an extent from this index alone (index/plan.py).
    # Its first column serves every lookup by extent (removal, cascades) as well.
    __table_args__ = (
        Index("ix_tkv_blocks_extent_slot", "extent_id", "slot", "namespace_id", "block_key"),
    )

    namespace_id: Mapped[bytes] = mapped_column(
        ForeignKey("tkv_namespaces.id", ondelete="CASCADE"), primary_key=True
    )
    block_key: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)
    extent_id: Mapped[str] = mapped_column(ForeignKey("tkv_extents.id", ondelete="CASCADE"))
    slot: Mapped[int]  # index of the block inside its extent
    position: Mapped[int]  # index of the block inside the prefix (0 = first 64 tokens)
    stored_at: Mapped[float]
    last_used_at: Mapped[float]


class Lease(Base):
    """A node's claim on an extent it is reading: while a live lease exists no node deletes the
    extent's bytes, and eviction, GC, re-sealing and purges pass it over.

    Rows, not process memory, so that every node sharing the index honours every other node's
    loads. A lease expires unless its node renews it, so a crashed node's claims lapse.
    """

    __tablename__ = "tkv_leases"
    __table_args__ = (Index("ix_tkv_leases_extent", "extent_id"),)

    lease_id: Mapped[bytes] = mapped_column(LargeBinary(16), primary_key=True)
    extent_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    node_id: Mapped[str] = mapped_column(String(64), index=True)
    expires_at: Mapped[float] = mapped_column(index=True)


class Counter(Base):
    """A named counter every node reads: ``key_epoch`` grows with every change to any tenant's
    keys (rotation, retirement, deletion), so each node's keyring notices changes made by
    another node and drops the clear keys it cached."""

    __tablename__ = "tkv_counters"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)
