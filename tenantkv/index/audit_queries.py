"""Reads of the audit tables that the audit package's log does not offer (listings)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..audit import AuditCheckpointRow


def checkpoints(session: Session, chain: str, limit: int = 1000) -> list[AuditCheckpointRow]:
    """Stored signed checkpoints of ``chain``, oldest first (at most ``limit``)."""
    return list(
        session.scalars(
            select(AuditCheckpointRow)
            .where(AuditCheckpointRow.chain == chain)
            .order_by(AuditCheckpointRow.seq, AuditCheckpointRow.time_us)
            .limit(limit)
        ).all()
    )
