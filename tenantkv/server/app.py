"""The admin service: ``create_app(kv, settings)`` for tests and embedding, ``run(settings)``
for ``tenantkv serve`` (uvicorn, loopback by default)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from .. import __version__
from ..api import TenantKV
from ..errors import TenantKVError
from ..json_logs import configure as configure_logs
from . import console, errors
from .body_limit import BodyLimit
from .gate import AuthGate
from .metrics import Metrics, RequestMiddleware
from .refusals import RefusalLog
from .routers import audit, inference_keys, jobs, system, tenants, tokens, usage
from .settings import Settings

logger = logging.getLogger("tenantkv.server")


def create_app(kv: TenantKV, settings: Settings | None = None) -> FastAPI:
    """The app serving ``kv`` (opening it made the token table). The caller owns ``kv``.

    Requests pass, outermost first: the request id and metrics, the :class:`AuthGate` (401
    before any body is read), the :class:`BodyLimit` (413), then the routes."""
    config = settings or Settings()
    refusals = RefusalLog(
        kv,
        window_seconds=config.refusal_window_seconds,
        max_sources=config.refusal_max_sources,
    )
    app = FastAPI(
        title="tenantkv admin API",
        version=__version__,
        description="Authenticated tenant management for tenantkv. See docs/admin-api.md.",
        lifespan=_flushing(refusals),
        docs_url=None,  # console.install serves /docs from local files, not a CDN
        redoc_url=None,
    )
    metrics = Metrics(kv, refusals)
    app.state.kv = kv
    app.state.settings = config
    app.state.metrics = metrics
    app.state.refusals = refusals
    errors.install(app)
    modules = (system, tenants, tokens, inference_keys, audit, jobs, usage)
    routers = [module.router for module in modules]
    for router in routers:
        app.include_router(router)
    public = {"/healthz", "/readyz", app.openapi_url, *console.install(app, title=app.title)}
    if config.metrics_public:
        public.add("/metrics")
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(
        AuthGate,
        kv=kv,
        refusals=refusals,
        public={path for path in public if path},
        # the routers' own routes (full paths): the application's may be wrapped (FastAPI
        # includes routers lazily), and the gate only needs their templates to label refusals
        routes=[route for router in routers for route in router.routes],
    )
    app.add_middleware(RequestMiddleware, metrics=metrics)
    _recover_jobs(kv)
    return app


def _recover_jobs(kv: TenantKV) -> None:
    """Mark the jobs whose runner died (this server before a restart, among others) as
    interrupted, so clients polling them learn it and an operator can resume them; an index
    that cannot be written now leaves that to the next read of each job."""
    try:
        kv.jobs.mark_interrupted()
    except TenantKVError as err:
        logger.warning("could not check for interrupted jobs at start: %s", err)


def _flushing(refusals: RefusalLog) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """A lifespan writing the refusal windows as they end, and the last one on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async def periodically() -> None:
            while True:
                await asyncio.sleep(refusals.window_seconds)
                await run_in_threadpool(refusals.flush_due)

        task = asyncio.create_task(periodically())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await run_in_threadpool(refusals.flush)

    return lifespan


def run(settings: Settings | None = None) -> None:
    """Open the cache at ``settings.root`` and serve it until interrupted.

    The cache must exist (``tenantkv init`` makes it and shows the bootstrap operator token,
    once): a root that holds none is refused (CacheNotFoundError) rather than created, and no
    token is ever printed here, since a server's output goes to its logs. A lost operator is
    recovered on the host with ``tenantkv token recover``."""
    import uvicorn

    from .. import open as open_cache

    config = settings or Settings()
    json_logs = config.log_format == "json"
    if json_logs:
        configure_logs("json", level=config.log_level, tenant_names=config.log_tenants)
    with open_cache(config.cache_config(), create=False) as kv:
        uvicorn.run(
            create_app(kv, config),
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            # JSON: uvicorn's loggers go to the root handler configured above, and the access
            # line is the app's own (route templates and request ids, no paths naming tenants)
            log_config=None if json_logs else uvicorn.config.LOGGING_CONFIG,
            access_log=not json_logs,
        )
