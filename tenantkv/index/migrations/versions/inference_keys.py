"""Inference keys (issue 34): the ``tkv_inference_keys`` table.

Revision ID: inference_keys
Revises: blocks_by_extent_slot

The table as its model (``tenantkv.index.inference_keys``) defines it today, written out here:
a revision must create the same table whatever the model becomes later. Created only where
missing.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import BigInteger, Column, Float, Index, LargeBinary, MetaData, String, Table

revision: str = "inference_keys"
down_revision: str | None = "blocks_by_extent_slot"
branch_labels: str | None = None
depends_on: str | None = None


def _tables() -> MetaData:
    metadata = MetaData()
    Table(
        "tkv_inference_keys",
        metadata,
        Column("id", String(32), primary_key=True),
        Column("key_hash", String(64), nullable=False, unique=True),
        Column("name", String(128), nullable=False),
        Column("tenant", String(128), nullable=False),
        Column("tenant_id", LargeBinary(16), nullable=False),
        Column("scope", String(256), nullable=True),
        Column("created_at", Float, nullable=False),
        Column("created_by", String(256), nullable=False),
        Column("expires_at", Float, nullable=True),
        Column("revoked_at", Float, nullable=True),
        Column("uses", BigInteger, nullable=False),
        Column("last_used_at", Float, nullable=True),
        Index("ix_tkv_inference_keys_tenant_id", "tenant_id"),
    )
    return metadata


def upgrade() -> None:
    _tables().create_all(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    raise NotImplementedError("tenantkv does not downgrade an index")
