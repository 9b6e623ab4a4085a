"""Settings of the admin service, from ``TENANTKV_*`` environment variables (pydantic-settings).

Tests build a :class:`Settings` directly and pass it to ``create_app``.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TENANTKV_", extra="ignore")

    root: str = Field(default="./tenantkv-data", description="cache root directory")
    host: str = Field(default="127.0.0.1", description="address to listen on (loopback only)")
    port: int = Field(default=8470, ge=0, le=65535)
    log_level: str = "info"
    metrics_public: bool = Field(
        default=False,
        description="serve /metrics without a token (for a scraper on a trusted network)",
    )
    max_token_ttl_seconds: float = Field(default=90 * 86400.0, gt=0, le=366 * 86400.0)
    default_token_ttl_seconds: float | None = Field(default=30 * 86400.0, gt=0)
