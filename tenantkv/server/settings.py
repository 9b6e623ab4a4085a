"""Settings of the admin service, from the configuration file's ``[server]`` table and
``TENANTKV_*`` environment variables (pydantic-settings; environment > file > defaults).

Tests build a :class:`Settings` directly and pass it to ``create_app``. The cache's own settings
(index and block-store URLs, workers, sizes) are a :class:`~tenantkv.config.CacheConfig`,
embedded through :meth:`Settings.cache_config`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ..config import CacheConfig, check_environment, config_for_root, default_root
from ..settings_file import CONFIG_ENV, Section, SettingsFile


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TENANTKV_", extra="ignore")

    root: str = Field(default_factory=default_root, description="cache root directory")
    host: str = Field(default="127.0.0.1", description="address to listen on (loopback only)")
    port: int = Field(default=8470, ge=0, le=65535)
    log_level: str = "info"
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="text (uvicorn's lines) or json (one object per line, with request ids)",
    )
    log_tenants: bool = Field(
        default=False,
        description="let log lines name the tenant a request concerns (off: a shipped log "
        "would list every tenant)",
    )
    metrics_public: bool = Field(
        default=False,
        description="serve /metrics without a token (for a scraper on a trusted network)",
    )
    max_token_ttl_seconds: float = Field(default=90 * 86400.0, gt=0, le=366 * 86400.0)
    default_token_ttl_seconds: float | None = Field(default=30 * 86400.0, gt=0, le=366 * 86400.0)
    max_body_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        le=16 * 1024 * 1024,
        description="largest request body accepted (413 beyond; the largest legitimate one is "
        "a few KiB)",
    )
    refusal_window_seconds: float = Field(
        default=60.0,
        ge=1.0,
        le=3600.0,
        description="refused authentications are audited as one record per source per window",
    )
    refusal_max_sources: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="sources audited by address per window; the rest are counted as 'other'",
    )

    def cache_config(self) -> CacheConfig:
        """The cache this service opens: ``root``, with every other cache setting from the same
        ``TENANTKV_*`` environment the CLI and the library's ``CacheConfig.from_env`` read."""
        return config_for_root(self.root)


#: The configuration file's ``[server]`` table. ``root`` is the cache's (``[cache] root``).
SERVER_SECTION = Section("server", Settings, exclude=frozenset({"root"}))


def load_settings(config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """The service's settings: ``overrides`` (command-line flags) > ``TENANTKV_*`` variables >
    the ``[server]`` table of ``config_file`` (else of the file ``TENANTKV_CONFIG`` names) >
    defaults. Every file value is checked first (unknown key, type, range), its error naming
    the file, line and field; an unknown ``TENANTKV_*`` variable is refused."""
    check_environment(os.environ)
    path = config_file or os.environ.get(CONFIG_ENV) or None
    if path is None:
        return Settings(**overrides)
    settings_file = SettingsFile.read(path)
    settings_file.check_sections()

    def build(values: dict[str, Any], environ: Any) -> Settings:
        kept = {k: v for k, v in values.items() if not environ.get(SERVER_SECTION.env_name(k))}
        return Settings(**{**kept, **overrides})

    settings: Settings = settings_file.build(
        dataclasses.replace(SERVER_SECTION, build=build), os.environ
    )
    return settings
