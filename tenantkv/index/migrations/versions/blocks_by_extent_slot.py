"""Blocks by extent and slot (issue 16): ``ix_tkv_blocks_extent`` (``extent_id``) becomes
``ix_tkv_blocks_extent_slot`` (``extent_id, slot, namespace_id, block_key``).

A load's plan finds one block of a prefix and then reads the rest of its run in that extent in
slot order; with the namespace and key in the index those rows come from the index alone, where
the old index cost a table lookup per block (docs/perf.md, "At 128K tokens"). The new index
leads with ``extent_id``, so it also serves every lookup the old one did, which goes.

Revision ID: blocks_by_extent_slot
Revises: identity_audit_macs
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import inspect

revision: str = "blocks_by_extent_slot"
down_revision: str | None = "identity_audit_macs"
branch_labels: str | None = None
depends_on: str | None = None

_TABLE = "tkv_blocks"
_OLD = "ix_tkv_blocks_extent"
_NEW = "ix_tkv_blocks_extent_slot"
_NEW_COLUMNS = ["extent_id", "slot", "namespace_id", "block_key"]


def upgrade() -> None:
    present = {index["name"] for index in inspect(op.get_bind()).get_indexes(_TABLE)}
    if _NEW not in present:
        op.create_index(_NEW, _TABLE, _NEW_COLUMNS)
    if _OLD in present:
        op.drop_index(_OLD, table_name=_TABLE)


def downgrade() -> None:
    raise NotImplementedError("tenantkv does not downgrade an index")
