"""The admin service: ``create_app(kv, settings)`` for tests and embedding, ``run(settings)``
for ``tenantkv serve`` (uvicorn, loopback by default)."""

from __future__ import annotations

import sys

from fastapi import FastAPI

from .. import __version__
from ..api import TenantKV
from . import errors
from .auth import ensure_first_operator_token, ensure_schema
from .metrics import Metrics, RequestMiddleware
from .routers import audit, system, tenants, tokens
from .settings import Settings


def create_app(kv: TenantKV, settings: Settings | None = None) -> FastAPI:
    """The app serving ``kv``; creates the token table if needed. The caller owns ``kv``."""
    ensure_schema(kv)
    app = FastAPI(
        title="tenantkv admin API",
        version=__version__,
        description="Authenticated tenant management for tenantkv. See docs/admin-api.md.",
    )
    metrics = Metrics()
    app.state.kv = kv
    app.state.settings = settings or Settings()
    app.state.metrics = metrics
    errors.install(app)
    for module in (system, tenants, tokens, audit):
        app.include_router(module.router)
    app.add_middleware(RequestMiddleware, metrics=metrics)
    return app


def run(settings: Settings | None = None) -> None:
    """Open the cache at ``settings.root`` and serve it until interrupted. Prints a first
    operator token to stderr when no usable one exists (once; only its hash is kept)."""
    import uvicorn

    from .. import open as open_cache

    config = settings or Settings()
    with open_cache(config.cache_config()) as kv:
        token = ensure_first_operator_token(kv)
        if token is not None:
            print(
                f"tenantkv: first operator token (shown once, store it now): {token}",
                file=sys.stderr,
            )
        uvicorn.run(
            create_app(kv, config),
            host=config.host,
            port=config.port,
            log_level=config.log_level,
        )
