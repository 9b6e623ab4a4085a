"""Prometheus metrics of the admin service (``prometheus_client``) and the request middleware
that feeds them.

``/metrics`` renders one registry of the service's own: request counters, refused
authentications, the cache's gauges (tenants, extents, bytes, capacity) read at scrape time,
and the cache's data-plane registry (``kv.metrics_registry``: hits, loads, evictions, health and
security events; see :mod:`tenantkv.components.metrics`).

Labels never carry tenant names, tokens or raw paths: a request is counted under its route
*template* (``/v1/tenants/{name}``), or ``unmatched``, with its method and status code. The
data-plane metrics carry tenant names only if the cache was opened with
``metrics_tenant_labels=True``.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from ..api import TenantKV
    from .refusals import RefusalLog

REQUEST_ID_KEY: Final = "tenantkv.request_id"
REQUEST_ID_HEADER: Final = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class Metrics:
    """The service's registry: request counters and latency sums, by (method, route template,
    status), the counts of refused authentications (by reason only: source addresses are
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

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self._requests.labels(method, route, str(status)).inc()
        self._seconds.labels(method, route).inc(seconds)

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
            self.metrics.observe(
                str(scope.get("method", "")),
                template if isinstance(template, str) else "unmatched",
                status,
                time.perf_counter() - started,
            )


def _header(scope: Scope, name: str) -> str | None:
    wanted = name.encode("ascii")
    for key, value in scope.get("headers", []):
        if key.lower() == wanted:
            try:
                return bytes(value).decode("ascii")
            except UnicodeDecodeError:
                return None
    return None
