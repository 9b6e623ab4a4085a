"""The inference keys' table (next to the admin tokens', in the same declarative base) and every
statement on it.

A row holds the SHA-256 of the key, never the key: a key carries 256 random bits, so a plain
hash is enough and a stolen index yields no usable key. A row is bound to its tenant's
immutable id (``tenant_id``), not only to its name: the lookup by hash joins the tenant's row
on that id, so a key whose tenant was deleted, or deleted and created again under the same
name, finds nothing, even where a deletion missed the row.

``uses`` and ``last_used_at`` are written by :func:`add_uses` in batches of counts kept in
memory (``tenantkv.components.key_uses``), never by the lookup itself: a gateway authenticates
every request, and a write per request would cap it at the index's commit rate.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import (
    BigInteger,
    Float,
    Index,
    LargeBinary,
    String,
    func,
    select,
    update,
)
from sqlalchemy.orm import Mapped, Session, mapped_column

from .api_tokens import ServerBase
from .schema import Tenant


class InferenceKey(ServerBase):
    __tablename__ = "tkv_inference_keys"
    __table_args__ = (Index("ix_tkv_inference_keys_tenant_id", "tenant_id"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # public: names the key
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the key
    name: Mapped[str] = mapped_column(String(128))
    tenant: Mapped[str] = mapped_column(String(128))  # the tenant's name when minted
    tenant_id: Mapped[bytes] = mapped_column(LargeBinary(16))  # the tenant's immutable id
    scope: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[float] = mapped_column(Float)
    created_by: Mapped[str] = mapped_column(String(256))
    expires_at: Mapped[float | None] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float)
    uses: Mapped[int] = mapped_column(BigInteger, default=0)
    last_used_at: Mapped[float | None] = mapped_column(Float)


def add(session: Session, row: InferenceKey) -> None:
    session.add(row)
    session.flush()


def by_hash(session: Session, digest: str) -> tuple[InferenceKey, bytes] | None:
    """The key whose hash is ``digest`` and its tenant's id, if that tenant still exists (one
    lookup on the unique hash, joined to the tenant's primary key)."""
    found = session.execute(
        select(InferenceKey, Tenant.id)
        .join(Tenant, Tenant.id == InferenceKey.tenant_id)
        .where(InferenceKey.key_hash == digest)
    ).first()
    return None if found is None else (found[0], bytes(found[1]))


def find(session: Session, key_id: str, tenant_id: bytes) -> InferenceKey | None:
    """The key ``key_id`` of the tenant ``tenant_id`` (another tenant's: None)."""
    return session.scalar(
        select(InferenceKey).where(InferenceKey.id == key_id, InferenceKey.tenant_id == tenant_id)
    )


def listing(session: Session, tenant_id: bytes) -> list[InferenceKey]:
    """One tenant's keys, newest first."""
    query = (
        select(InferenceKey)
        .where(InferenceKey.tenant_id == tenant_id)
        .order_by(InferenceKey.created_at.desc(), InferenceKey.id)
    )
    return list(session.scalars(query).all())


def revoke_all_of(session: Session, tenant_id: bytes, now: float) -> int:
    """Revoke every live key of the tenant ``tenant_id``; return how many."""
    result = session.execute(
        update(InferenceKey)
        .where(InferenceKey.tenant_id == tenant_id, InferenceKey.revoked_at.is_(None))
        .values(revoked_at=now)
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def add_uses(session: Session, counts: Mapping[str, tuple[int, float]]) -> None:
    """Add ``counts`` (key id -> uses, time of the latest) to the keys' counters: one relative
    update per key, so nodes counting the same key add up rather than overwrite each other."""
    for key_id, (uses, last_used) in sorted(counts.items()):  # one lock order for every node
        session.execute(
            update(InferenceKey)
            .where(InferenceKey.id == key_id)
            .values(
                uses=InferenceKey.uses + uses,
                last_used_at=func.coalesce(
                    func.max(InferenceKey.last_used_at, last_used)
                    if session.get_bind().dialect.name == "sqlite"
                    else func.greatest(InferenceKey.last_used_at, last_used),
                    last_used,
                ),
            )
            .execution_options(synchronize_session=False)
        )
