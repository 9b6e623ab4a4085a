"""The admin API's token table (its own declarative base, next to the cache's tables) and
every statement on it.

A token row holds the SHA-256 of the token, never the token itself: the token carries 256 bits
of randomness, so a plain hash is enough (no password-style KDF is needed) and a stolen index
does not yield usable credentials.
"""

from __future__ import annotations

from sqlalchemy import Float, String, select, update
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column


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


def usable_operator_exists(session: Session, now: float) -> bool:
    """Whether an unrevoked, unexpired operator token exists."""
    existing = session.scalar(
        select(ApiToken.id).where(
            ApiToken.role == "operator",
            ApiToken.revoked_at.is_(None),
            (ApiToken.expires_at.is_(None)) | (ApiToken.expires_at > now),
        )
    )
    return existing is not None


def add(session: Session, row: ApiToken) -> None:
    session.add(row)
    session.flush()


def find(session: Session, token_id: str, tenant: str | None = None) -> ApiToken | None:
    """The token ``token_id`` (of ``tenant`` only, if given)."""
    query = select(ApiToken).where(ApiToken.id == token_id)
    if tenant is not None:
        query = query.where(ApiToken.tenant == tenant)
    return session.scalar(query)


def by_hash(session: Session, digest: str) -> ApiToken | None:
    return session.scalar(select(ApiToken).where(ApiToken.token_hash == digest))


def revoke_all_of(session: Session, tenant: str, now: float) -> int:
    """Revoke every live token bound to ``tenant``; return how many."""
    result = session.execute(
        update(ApiToken)
        .where(ApiToken.tenant == tenant, ApiToken.revoked_at.is_(None))
        .values(revoked_at=now)
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def listing(session: Session, tenant: str | None) -> list[ApiToken]:
    """Every token (or one tenant's), newest first."""
    query = select(ApiToken).order_by(ApiToken.created_at.desc(), ApiToken.id)
    if tenant is not None:
        query = query.where(ApiToken.tenant == tenant)
    return list(session.scalars(query).all())
