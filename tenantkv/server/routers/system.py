"""``/healthz`` and ``/readyz`` (no authentication) and ``/metrics`` (Prometheus text format).

``/healthz`` says the process is alive and its cache open (a liveness probe: restart me if
not); ``/readyz`` says the cache can serve (a readiness probe: the index answers, its schema is
current, the block store takes a write; ``kv.health()``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ...errors import TenantKVError
from ..dependencies import KV, AppMetrics, AppSettings, Credentials, caller_of, check_role

router = APIRouter(tags=["system"])


@router.get("/healthz")
def healthz(kv: KV) -> JSONResponse:
    """200 while the server runs with its cache open. Touches neither the index nor the block
    store: an outage of either is ``/readyz``'s answer, and restarting the server would not
    cure it. Reveals nothing about tenants."""
    if kv.closed:
        return JSONResponse({"status": "closed"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
def readyz(kv: KV) -> JSONResponse:
    """200 when the index answers, its schema is current and the block store takes a write;
    503 otherwise, with each check's state (``"ok"`` or what failed, never a driver's text).
    Reveals nothing about tenants."""
    try:
        report = kv.health()
    except TenantKVError:  # closed
        return JSONResponse({"status": "unavailable", "checks": {}}, status_code=503)
    return JSONResponse(report.as_dict(), status_code=200 if report.ready else 503)


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(
    request: Request,
    kv: KV,
    settings: AppSettings,
    metrics: AppMetrics,
    credentials: Credentials,
) -> PlainTextResponse:
    """Aggregates only: no tenant names or secrets in any label (unless the cache was opened
    with ``metrics_tenant_labels``). Operators and auditors (or anyone, with
    ``metrics_public``)."""
    if not settings.metrics_public:
        check_role(request, kv, caller_of(request, kv, credentials), ("operator", "auditor"))
    return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE_LATEST)
