"""The admin API's own tables, on their own declarative base next to the cache's tables.

A token row holds the SHA-256 of the token, never the token itself: the token carries 256 bits
of randomness, so a plain hash is enough (no password-style KDF is needed) and a stolen index
does not yield usable credentials.
"""

from __future__ import annotations

from sqlalchemy import Float, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


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
