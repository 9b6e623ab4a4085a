"""The admin API's token table (its own declarative base, next to the cache's tables) and
every statement on it.

A token row holds the SHA-256 of the token, never the token itself: the token carries 256 bits
of randomness, so a plain hash is enough (no password-style KDF is needed) and a stolen index
does not yield usable credentials.

**Identity.** A row names its tenant by the tenant's immutable id (``tenant_id``), not only by
name: a tenant deleted and created again under the same name is another tenant, and its
predecessor's admins must not control it. ``minted_by`` is the id of the token whose holder made
this one (None: the cache's own process or CLI made it). A token is valid only while it and every
token up its chain of minters is unrevoked and unexpired and, for a tenant-admin token, its
tenant id still exists (:func:`chain_of`), so revoking a token revokes everything minted under
it, and deleting a tenant disables its tokens even where a row was missed.

**Older indexes.** Tables made before ``tenant_id`` and ``minted_by`` existed get them from the
schema migration ``identity_audit_macs`` (``tenantkv db upgrade``), which recovers ``minted_by``
from ``created_by`` (``token:<id>``) and fills ``tenant_id`` in only where the tenant of that
name was created before the token (so the token was made for it, not for a deleted
predecessor); the other tenant-admin tokens stay unbound and are refused: an operator makes new
ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sqlalchemy import (
    Float,
    Index,
    LargeBinary,
    String,
    literal,
    select,
    update,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from .schema import Tenant

#: Longest chain of minters followed; a longer one (never made by the admin API in practice) is
#: refused rather than walked without end.
MAX_CHAIN: Final = 64
_TENANT_ADMIN: Final = "tenant-admin"


class ServerBase(DeclarativeBase):
    pass


class ApiToken(ServerBase):
    __tablename__ = "tkv_api_tokens"
    __table_args__ = (
        Index("ix_tkv_api_tokens_tenant_id", "tenant_id"),
        Index("ix_tkv_api_tokens_minted_by", "minted_by"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # public: names the token
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the token
    role: Mapped[str] = mapped_column(String(32))
    tenant: Mapped[str | None] = mapped_column(String(128), index=True)  # name when made
    created_at: Mapped[float] = mapped_column(Float)
    created_by: Mapped[str] = mapped_column(String(256))
    expires_at: Mapped[float | None] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float)
    tenant_id: Mapped[bytes | None] = mapped_column(LargeBinary(16))  # the tenant's immutable id
    minted_by: Mapped[str | None] = mapped_column(String(32))  # the minting token's id
    name: Mapped[str | None] = mapped_column(String(128))  # what it is for (listings, whoami)


@dataclass(frozen=True)
class ChainLink:
    """One token of a chain of minters, as validity needs it."""

    id: str
    minted_by: str | None
    revoked_at: float | None
    expires_at: float | None


def chain_of(session: Session, token_id: str) -> list[ChainLink]:
    """``token_id``'s row and its minters' rows, the token first (one recursive query on the
    primary key; at most :data:`MAX_CHAIN` links)."""
    first = (
        select(
            ApiToken.id,
            ApiToken.minted_by,
            ApiToken.revoked_at,
            ApiToken.expires_at,
            literal(1).label("depth"),
        )
        .where(ApiToken.id == token_id)
        .cte("chain", recursive=True)
    )
    minter = ServerBase.metadata.tables[ApiToken.__tablename__].alias("minter")
    walked = first.union_all(
        select(
            minter.c.id,
            minter.c.minted_by,
            minter.c.revoked_at,
            minter.c.expires_at,
            (first.c.depth + 1).label("depth"),
        ).where(minter.c.id == first.c.minted_by, first.c.depth < MAX_CHAIN + 1)
    )
    rows = session.execute(
        select(walked.c.id, walked.c.minted_by, walked.c.revoked_at, walked.c.expires_at).order_by(
            walked.c.depth
        )
    ).all()
    return [ChainLink(str(r[0]), r[1], r[2], r[3]) for r in rows]


def chain_problem(links: list[ChainLink], now: float) -> str | None:
    """Why a chain of minters (as :func:`chain_of` returns it) does not make its first token
    valid: ``"revoked"``, ``"expired"`` or ``"minter-missing"``; None if it does."""
    if not links or len(links) > MAX_CHAIN:
        return "minter-missing"
    for link in links:
        if link.revoked_at is not None:
            return "revoked"
        if link.expires_at is not None and now >= link.expires_at:
            return "expired"
    if links[-1].minted_by is not None:  # the chain ends at a token that no longer exists
        return "minter-missing"
    return None


def tenant_exists(session: Session, tenant_id: bytes, *, lock: bool = False) -> str | None:
    """The name of the tenant ``tenant_id`` if it exists. With ``lock``, its row is share-locked
    until the transaction ends, so a deletion (which locks it for update) waits for a mint that
    checked it, and revokes what that mint made; on SQLite write transactions are serial."""
    query = select(Tenant.name).where(Tenant.id == tenant_id)
    if lock:
        query = query.with_for_update(read=True)
    name = session.scalar(query)
    return None if name is None else str(name)


def tenant_id_for_mint(session: Session, name: str) -> bytes | None:
    """The id of the tenant named ``name``, its row share-locked until the transaction ends
    (see :func:`tenant_exists`)."""
    tenant_id = session.scalar(
        select(Tenant.id).where(Tenant.name == name).with_for_update(read=True)
    )
    return None if tenant_id is None else bytes(tenant_id)


def any_operator(session: Session) -> bool:
    """Whether an operator token was ever made on this index (revoked or expired ones count)."""
    first = session.scalar(select(ApiToken.id).where(ApiToken.role == "operator").limit(1))
    return first is not None


def add(session: Session, row: ApiToken) -> None:
    session.add(row)
    session.flush()


def find(session: Session, token_id: str, tenant_id: bytes | None = None) -> ApiToken | None:
    """The token ``token_id`` (of tenant ``tenant_id`` only, if given)."""
    query = select(ApiToken).where(ApiToken.id == token_id)
    if tenant_id is not None:
        query = query.where(ApiToken.tenant_id == tenant_id)
    return session.scalar(query)


def by_hash(session: Session, digest: str) -> ApiToken | None:
    return session.scalar(select(ApiToken).where(ApiToken.token_hash == digest))


def revoke_all_of(session: Session, tenant_id: bytes, now: float) -> int:
    """Revoke every live token bound to the tenant ``tenant_id``; return how many."""
    result = session.execute(
        update(ApiToken)
        .where(ApiToken.tenant_id == tenant_id, ApiToken.revoked_at.is_(None))
        .values(revoked_at=now)
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def listing(session: Session, tenant_id: bytes | None) -> list[ApiToken]:
    """Every token (or one tenant's), newest first."""
    query = select(ApiToken).order_by(ApiToken.created_at.desc(), ApiToken.id)
    if tenant_id is not None:
        query = query.where(ApiToken.tenant_id == tenant_id)
    return list(session.scalars(query).all())
