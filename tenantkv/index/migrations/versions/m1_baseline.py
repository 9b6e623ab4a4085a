"""Baseline: the milestone-1 schema (index, admin token table, audit log without MACs).

Revision ID: m1_baseline
Revises: (none)

A frozen copy of the tables as milestone 1 (commit 2e18036) created them, never the models of
today: a revision must create the same tables whatever the models become later. Each table is
created only where it is missing, because an index made before migrations existed carries no
revision: ``tenantkv db upgrade`` runs every revision on it from here, and this one must then
leave its tables (and the rows in them) as they are. The token table is among them, though
milestone 1 made it only when the admin server first ran.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import (
    BigInteger,
    Column,
    Double,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

revision: str = "m1_baseline"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def _milestone1() -> MetaData:
    metadata = MetaData()
    Table(
        "tkv_schema",
        metadata,
        Column("name", String(64), primary_key=True),
        Column("value", String(256), nullable=False),
    )
    Table(
        "tkv_tenants",
        metadata,
        Column("id", LargeBinary(16), primary_key=True),
        Column("name", String(128), nullable=False, unique=True),
        Column("created_at", Double, nullable=False),
        Column("updated_at", Double, nullable=False),
        Column("current_key_version", Integer, nullable=False),
        Column("quota_bytes", BigInteger, nullable=False),
        Column("retention", String(1024), nullable=False),
    )
    Table(
        "tkv_data_keys",
        metadata,
        Column(
            "tenant_id",
            LargeBinary(16),
            ForeignKey("tkv_tenants.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        Column("version", Integer, primary_key=True, autoincrement=False),
        Column("wrapped_key", LargeBinary, nullable=False),
        Column("created_at", Double, nullable=False),
    )
    Table(
        "tkv_namespaces",
        metadata,
        Column("id", LargeBinary(16), primary_key=True),
        Column(
            "tenant_id",
            LargeBinary(16),
            ForeignKey("tkv_tenants.id", ondelete="CASCADE"),
            nullable=False,
        ),
        Column("scope", String(256), nullable=False),
        Column("model", String(256), nullable=False),
        Column("fingerprint", String(64), nullable=False),
        Column("wrapped_hash_key", LargeBinary, nullable=False),
        Column("created_at", Double, nullable=False),
        UniqueConstraint("tenant_id", "scope", "fingerprint"),
    )
    Table(
        "tkv_extents",
        metadata,
        Column("id", String(32), primary_key=True),
        Column(
            "namespace_id",
            LargeBinary(16),
            ForeignKey("tkv_namespaces.id", ondelete="CASCADE"),
            nullable=False,
            index=True,
        ),
        Column(
            "tenant_id",
            LargeBinary(16),
            ForeignKey("tkv_tenants.id", ondelete="CASCADE"),
            nullable=False,
            index=True,
        ),
        Column("key_version", Integer, nullable=False),
        Column("kind", String(64), nullable=False),
        Column("suite", Integer, nullable=False),
        Column("salt", LargeBinary(16), nullable=False),
        Column("num_blocks", Integer, nullable=False),
        Column("num_layers", Integer, nullable=False),
        Column("segment_bytes", Integer, nullable=False),
        Column("size_bytes", BigInteger, nullable=False),
        Column("created_at", Double, nullable=False),
        Column("last_used_at", Double, nullable=False, index=True),
        Column("expires_at", Double, nullable=False, index=True),
    )
    counters = (
        "hit_tokens",
        "miss_tokens",
        "served_tokens",
        "stored_tokens",
        "stored_bytes",
        "evicted_extents",
        "evicted_bytes",
        "expired_extents",
        "expired_bytes",
    )
    Table(
        "tkv_usage",
        metadata,
        Column(
            "tenant_id",
            LargeBinary(16),
            ForeignKey("tkv_tenants.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        Column("scope", String(256), primary_key=True),
        Column("bucket", BigInteger, primary_key=True, autoincrement=False),
        *(Column(name, BigInteger, nullable=False) for name in counters),
    )
    Table(
        "tkv_blocks",
        metadata,
        Column(
            "namespace_id",
            LargeBinary(16),
            ForeignKey("tkv_namespaces.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        Column("block_key", LargeBinary(32), primary_key=True),
        Column(
            "extent_id",
            String(32),
            ForeignKey("tkv_extents.id", ondelete="CASCADE"),
            nullable=False,
        ),
        Column("slot", Integer, nullable=False),
        Column("position", Integer, nullable=False),
        Column("stored_at", Double, nullable=False),
        Column("last_used_at", Double, nullable=False),
        Index("ix_tkv_blocks_extent", "extent_id"),
    )
    Table(
        "tkv_api_tokens",
        metadata,
        Column("id", String(32), primary_key=True),
        Column("token_hash", String(64), nullable=False, unique=True),
        Column("role", String(32), nullable=False),
        Column("tenant", String(128), nullable=True, index=True),
        Column("created_at", Float, nullable=False),
        Column("created_by", String(256), nullable=False),
        Column("expires_at", Float, nullable=True),
        Column("revoked_at", Float, nullable=True),
    )
    Table(
        "tkv_audit_records",
        metadata,
        Column("chain", String(160), primary_key=True),
        Column("seq", BigInteger, primary_key=True, autoincrement=False),
        Column("time_us", BigInteger, nullable=False),
        Column("actor", String(256), nullable=False),
        Column("role", String(64), nullable=False),
        Column("tenant", String(128), nullable=True),
        Column("action", String(64), nullable=False),
        Column("target", String(512), nullable=False),
        Column("outcome", String(16), nullable=False),
        Column("request_id", String(128), nullable=True),
        Column("details", Text, nullable=False),
        Column("prev_hash", String(64), nullable=False),
        Column("hash", String(64), nullable=False),
        Index("ix_tkv_audit_records_chain_time", "chain", "time_us"),
    )
    Table(
        "tkv_audit_heads",
        metadata,
        Column("chain", String(160), primary_key=True),
        Column("last_seq", BigInteger, nullable=False),
        Column("last_hash", String(64), nullable=False),
    )
    Table(
        "tkv_audit_checkpoints",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("chain", String(160), nullable=False),
        Column("seq", BigInteger, nullable=False),
        Column("head_hash", String(64), nullable=False),
        Column("count", BigInteger, nullable=False),
        Column("time_us", BigInteger, nullable=False),
        Column("key_id", String(64), nullable=False),
        Column("signature", LargeBinary(64), nullable=False),
        Index("ix_tkv_audit_checkpoints_chain_seq", "chain", "seq"),
    )
    Table(
        "tkv_audit_signing_keys",
        metadata,
        Column("name", String(32), primary_key=True),
        Column("key_id", String(64), nullable=False, unique=True),
        Column("algorithm", String(16), nullable=False),
        Column("public_key", LargeBinary(32), nullable=False),
        Column("wrapped_private_key", LargeBinary, nullable=False),
        Column("created_at_us", BigInteger, nullable=False),
    )
    return metadata


def upgrade() -> None:
    _milestone1().create_all(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    raise NotImplementedError("tenantkv does not downgrade an index")
