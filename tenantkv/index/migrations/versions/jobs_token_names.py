"""Jobs and token names (issue 37): the ``tkv_jobs`` table and the token table's ``name``.

Revision ID: jobs_token_names
Revises: inference_keys

The table as its model (``tenantkv.index.jobs``) defines it today, written out here: a revision
must create the same table whatever the model becomes later. The table is created and the
column added only where missing. Tokens made before this revision have no name (None).
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import Column, Float, Index, Integer, MetaData, String, Table, Text, inspect

revision: str = "jobs_token_names"
down_revision: str | None = "inference_keys"
branch_labels: str | None = None
depends_on: str | None = None


def _tables() -> MetaData:
    metadata = MetaData()
    Table(
        "tkv_jobs",
        metadata,
        Column("id", String(32), primary_key=True),
        Column("kind", String(32), nullable=False),
        Column("tenant", String(128), nullable=True),
        Column("params", Text, nullable=False),
        Column("state", String(16), nullable=False),
        Column("created_at", Float, nullable=False),
        Column("created_by", String(256), nullable=False),
        Column("created_role", String(32), nullable=False),
        Column("started_at", Float, nullable=True),
        Column("finished_at", Float, nullable=True),
        Column("heartbeat_at", Float, nullable=True),
        Column("runner", String(256), nullable=True),
        Column("done", Integer, nullable=False),
        Column("total", Integer, nullable=True),
        Column("attempts", Integer, nullable=False),
        Column("result", Text, nullable=True),
        Column("error", Text, nullable=True),
        Index("ix_tkv_jobs_state", "state"),
    )
    return metadata


def upgrade() -> None:
    bind = op.get_bind()
    _tables().create_all(bind, checkfirst=True)
    columns = {c["name"] for c in inspect(bind).get_columns("tkv_api_tokens")}
    if "name" not in columns:
        op.add_column("tkv_api_tokens", Column("name", String(128), nullable=True))


def downgrade() -> None:
    raise NotImplementedError("tenantkv does not downgrade an index")
