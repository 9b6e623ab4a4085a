"""Fleet coordination tables (issue 12): leases on extents being read, shared counters.

Revision ID: fleet_tables
Revises: m1_baseline

Created only where missing: an index opened by a tenantkv between milestone 1 and migrations
already has them (see ``m1_baseline``).
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import BigInteger, Column, Double, Index, LargeBinary, MetaData, String, Table

revision: str = "fleet_tables"
down_revision: str | None = "m1_baseline"
branch_labels: str | None = None
depends_on: str | None = None


def _tables() -> MetaData:
    metadata = MetaData()
    Table(
        "tkv_leases",
        metadata,
        Column("lease_id", LargeBinary(16), primary_key=True),
        Column("extent_id", String(32), primary_key=True),
        Column("node_id", String(64), nullable=False, index=True),
        Column("expires_at", Double, nullable=False, index=True),
        Index("ix_tkv_leases_extent", "extent_id"),
    )
    Table(
        "tkv_counters",
        metadata,
        Column("name", String(64), primary_key=True),
        Column("value", BigInteger, nullable=False),
    )
    return metadata


def upgrade() -> None:
    _tables().create_all(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    raise NotImplementedError("tenantkv does not downgrade an index")
