"""Bytes served (issue 37): the usage table's ``served_bytes`` counter.

Revision ID: usage_served_bytes
Revises: jobs_token_names

Added only where missing, as a 64-bit count that is 0 in the buckets written before this
revision: those loads were not counted in bytes, and a zero is what an additive upsert needs to
add later flushes to.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import BigInteger, Column, inspect, text

revision: str = "usage_served_bytes"
down_revision: str | None = "jobs_token_names"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    columns = {c["name"] for c in inspect(op.get_bind()).get_columns("tkv_usage")}
    if "served_bytes" not in columns:
        op.add_column(
            "tkv_usage",
            Column("served_bytes", BigInteger, nullable=False, server_default=text("0")),
        )


def downgrade() -> None:
    raise NotImplementedError("tenantkv does not downgrade an index")
