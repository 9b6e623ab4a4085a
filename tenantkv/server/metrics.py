"""Prometheus metrics of the admin service (``prometheus_client``) and the request middleware
that feeds them.

``/metrics`` renders one registry of the service's own: request counters, refused
authentications, the cache's gauges (tenants, extents, bytes, capacity) read at scrape time,
and the cache's data-plane registry (``kv.metrics_registry``: hits, loads, evictions, health and
security events; see :mod:`tenantkv.components.metrics`).

Every label value comes from a set fixed by the code, never from what a client sends: each
distinct value is a series kept in memory and rendered at every scrape for the life of the
process, so a client that chose label values (anonymous requests with invented methods, say: the
server accepts any token as a method) could grow the registry and ``/metrics`` without bound. A
request is counted under its method if it is a standard one (else ``other``), its route
*template* (``/v1/tenants/{name}``; ``unmatched`` for a path no route matches) and its status
class (``2xx``, ``4xx``, ...). Refusal reasons are the token service's fixed reasons. The
data-plane metrics carry tenant names only if the cache was opened with
``metrics_tenant_labels=True``: those are bounded by the tenants an operator created.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..json_logs import REQUEST_ID
from .gate import PRINCIPAL_KEY

if TYPE_CHECKING:
    from ..api import TenantKV
    from .refusals import RefusalLog

#: One line per admin API request (``_log_access``); INFO, so silent unless logging asks.
access_logger = logging.getLogger("tenantkv.access")

REQUEST_ID_KEY: Final = "tenantkv.request_id"
REQUEST_ID_HEADER: Final = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

#: The methods of RFC 9110 and PATCH (RFC 5789), counted under their own names.
STANDARD_METHODS: Final = frozenset(
    ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT")
)
#: The method label of every other token a client sends as a method.
OTHER_METHOD: Final = "other"
#: The route label of a path that no route matches.
UNMATCHED_ROUTE: Final = "unmatched"
#: The status label of a status outside 100-599 (no server sends one; bounded all the same).
OTHER_STATUS: Final = "other"


def method_label(method: str) -> str:
    """``method`` if it is a standard method (case matters: methods are case-sensitive),
    else ``other``."""
    return method if method in STANDARD_METHODS else OTHER_METHOD


def status_label(status: int) -> str:
    """The class of ``status``: ``1xx`` to ``5xx``, or ``other``."""
    return f"{status // 100}xx" if 100 <= status <= 599 else OTHER_STATUS


class Metrics:
    """The service's registry: request counters and latency sums, by (method, route template,
    status class), the counts of refused authentications (by reason only: source addresses are
    unbounded), the cache's gauges and its data-plane metrics."""

    def __init__(self, kv: TenantKV, refusals: RefusalLog | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "tenantkv_http_requests",
            "Admin API requests.",
            ("method", "route", "status"),
            registry=self.registry,
        )
        self._seconds = Counter(
            "tenantkv_http_request_seconds",
            "Time spent answering admin API requests.",
            ("method", "route"),
            registry=self.registry,
        )
        self.registry.register(_CacheGauges(kv))
        if refusals is not None:
            self.registry.register(_Refusals(refusals))
        if kv.metrics_registry is not None:
            self.registry.register(_Included(kv.metrics_registry))

    def observe(self, method: str, route: str | None, status: int, seconds: float) -> None:
        """Count one request. ``method`` is whatever the client sent and ``route`` the matched
        route's template (None: no route matched); both are bounded here, where every request
        is counted, so no caller can add a label value the code did not fix."""
        method_value = method_label(method)
        route_value = route if route is not None else UNMATCHED_ROUTE
        self._requests.labels(method_value, route_value, status_label(status)).inc()
        self._seconds.labels(method_value, route_value).inc(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition format (0.0.4)."""
        return generate_latest(self.registry)


class _CacheGauges(Collector):
    """What the index holds now (one ``info()`` per scrape)."""

    def __init__(self, kv: TenantKV) -> None:
        self._kv = kv

    def describe(self) -> list[Any]:
        names = ("tenants", "extents", "cached_bytes", "capacity_bytes")
        return [GaugeMetricFamily(f"tenantkv_{name}", "") for name in names]

    def collect(self) -> Iterator[Any]:
        info = self._kv.info()
        yield GaugeMetricFamily("tenantkv_tenants", "Tenants in the cache.", info["tenants"])
        yield GaugeMetricFamily("tenantkv_extents", "Cached extents.", info["extents"])
        yield GaugeMetricFamily(
            "tenantkv_cached_bytes",
            "Bytes of cached KV (plaintext size) in the index now.",
            info["stored_bytes"],
        )
        yield GaugeMetricFamily(
            "tenantkv_capacity_bytes",
            "Capacity that tenant quotas reserve from.",
            info["capacity_bytes"],
        )


class _Refusals(Collector):
    """Refused authentications, from the refusal log's own counters at scrape time."""

    def __init__(self, refusals: RefusalLog) -> None:
        self._refusals = refusals

    def describe(self) -> list[Any]:
        names = ("refused", "refused_folded", "refusal_records", "refusal_flush_errors")
        return [CounterMetricFamily(f"tenantkv_auth_{name}", "") for name in names]

    def collect(self) -> Iterator[Any]:
        stats = self._refusals.stats()
        refused = CounterMetricFamily(
            "tenantkv_auth_refused",
            "Requests refused for want of a valid token (401).",
            labels=["reason"],
        )
        for reason, count in sorted(stats.refused.items()):
            refused.add_metric([reason], count)
        yield refused
        yield CounterMetricFamily(
            "tenantkv_auth_refused_folded",
            "401s counted under 'other' (past the sources audited by address in their window).",
            value=stats.folded,
        )
        yield CounterMetricFamily(
            "tenantkv_auth_refusal_records",
            "Aggregate access.refused records written.",
            value=stats.records,
        )
        yield CounterMetricFamily(
            "tenantkv_auth_refusal_flush_errors",
            "Windows of 401s that could not be audited.",
            value=stats.flush_errors,
        )


class _Included(Collector):
    """Another registry's metrics (the cache's data plane), rendered as part of this one."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Any]:
        yield from self._registry.collect()


def request_id_of(scope: Scope) -> str:
    value = scope.get(REQUEST_ID_KEY)
    return value if isinstance(value, str) else uuid.uuid4().hex


class RequestMiddleware:
    """Gives each request an id (the caller's ``X-Request-ID`` if well-formed, else a new one),
    echoes it on the response, and counts the request by route template."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, REQUEST_ID_HEADER)
        request_id = given if given and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope[REQUEST_ID_KEY] = request_id
        id_token = REQUEST_ID.set(request_id)  # every line logged while it runs carries it
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode("ascii")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route: Any = scope.get("route")
            template = getattr(route, "path", None)
            seconds = time.perf_counter() - started
            self.metrics.observe(
                str(scope.get("method", "")),
                template if isinstance(template, str) else None,
                status,
                seconds,
            )
            if access_logger.isEnabledFor(logging.INFO):
                _log_access(scope, template if isinstance(template, str) else None, status, seconds)
            REQUEST_ID.reset(id_token)


def _log_access(scope: Scope, template: str | None, status: int, seconds: float) -> None:
    """One line per request: the route's template, never its path (which names tenants) nor
    its query or body; the tenant as a field of its own, which the JSON formatter keeps only
    where the operator allows tenant names in logs."""
    method = str(scope.get("method", ""))
    route = template or "unmatched"
    params = scope.get("path_params") or {}
    principal = scope.get(PRINCIPAL_KEY)
    tenant = params.get("name") or getattr(principal, "tenant", None)
    extra: dict[str, Any] = {
        "method": method,
        "route": route,
        "status": status,
        "duration_ms": round(seconds * 1000, 3),
    }
    if isinstance(tenant, str):
        extra["tenant"] = tenant
    access_logger.info("%s %s %d", method, route, status, extra=extra)


def _header(scope: Scope, name: str) -> str | None:
    wanted = name.encode("ascii")
    for key, value in scope.get("headers", []):
        if key.lower() == wanted:
            try:
                return bytes(value).decode("ascii")
            except UnicodeDecodeError:
                return None
    return None
