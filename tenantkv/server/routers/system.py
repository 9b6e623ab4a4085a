"""``/healthz`` (no authentication) and ``/metrics`` (Prometheus text format)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ...errors import TenantKVError
from ..dependencies import KV, AppMetrics, AppSettings, Credentials, caller_of, check_role

router = APIRouter(tags=["system"])


@router.get("/healthz")
def healthz(kv: KV) -> JSONResponse:
    """200 when the index answers; 503 otherwise. Reveals nothing about tenants."""
    try:
        kv.check_available()
    except TenantKVError:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


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
