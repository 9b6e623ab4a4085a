"""Prometheus metrics (text exposition format) and the request middleware that feeds them.

Labels never carry tenant names, tokens or raw paths: a request is counted under its route
*template* (``/v1/tenants/{name}``), or ``unmatched``, with its method and status code.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any, Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..health import SCRUB_PENDING

if TYPE_CHECKING:
    from ..api import TenantKV
    from .refusals import RefusalLog

REQUEST_ID_KEY: Final = "tenantkv.request_id"
REQUEST_ID_HEADER: Final = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class Metrics:
    """Request counters and latency sums, by (method, route template, status), and the counts
    of refused authentications (by reason only: source addresses are unbounded)."""

    def __init__(self, refusals: RefusalLog | None = None) -> None:
        self._refusals = refusals
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str, int]] = Counter()
        self._seconds: dict[tuple[str, str], float] = {}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self._requests[(method, route, status)] += 1
            self._seconds[(method, route)] = self._seconds.get((method, route), 0.0) + seconds

    def render(self, kv: TenantKV) -> str:
        info = kv.info()
        lines = [
            "# HELP tenantkv_tenants Tenants in the cache.",
            "# TYPE tenantkv_tenants gauge",
            f"tenantkv_tenants {info['tenants']}",
            "# HELP tenantkv_extents Cached extents.",
            "# TYPE tenantkv_extents gauge",
            f"tenantkv_extents {info['extents']}",
            "# HELP tenantkv_stored_bytes Bytes of cached KV (plaintext size).",
            "# TYPE tenantkv_stored_bytes gauge",
            f"tenantkv_stored_bytes {info['stored_bytes']}",
            "# HELP tenantkv_capacity_bytes Capacity that tenant quotas reserve from.",
            "# TYPE tenantkv_capacity_bytes gauge",
            f"tenantkv_capacity_bytes {info['capacity_bytes']}",
            "# HELP tenantkv_security_events_total Security events recorded by this process.",
            "# TYPE tenantkv_security_events_total counter",
        ]
        for kind, count in sorted(kv.security_events().items()):
            lines.append(f'tenantkv_security_events_total{{kind="{_label(kind)}"}} {count}')
        health = kv.health_counters()
        lines += [
            "# HELP tenantkv_scrub_pending 1 while shredded keys may still be in the index's "
            "files (an incomplete scrub that the next GC run retries), else 0.",
            "# TYPE tenantkv_scrub_pending gauge",
            f"tenantkv_scrub_pending {health.pop(SCRUB_PENDING, 0)}",
            "# HELP tenantkv_health_events_total Faults of this process that are not security "
            "events: lost extents, operations degraded to a miss, incomplete scrubs.",
            "# TYPE tenantkv_health_events_total counter",
        ]
        for kind, count in sorted(health.items()):
            lines.append(f'tenantkv_health_events_total{{kind="{_label(kind)}"}} {count}')
        with self._lock:
            requests = sorted(self._requests.items())
            seconds = sorted(self._seconds.items())
        lines += [
            "# HELP tenantkv_http_requests_total Admin API requests.",
            "# TYPE tenantkv_http_requests_total counter",
        ]
        for (method, route, status), count in requests:
            lines.append(
                f'tenantkv_http_requests_total{{method="{_label(method)}",'
                f'route="{_label(route)}",status="{status}"}} {count}'
            )
        lines += [
            "# HELP tenantkv_http_request_seconds_total Time spent answering admin API requests.",
            "# TYPE tenantkv_http_request_seconds_total counter",
        ]
        for (method, route), total in seconds:
            lines.append(
                f'tenantkv_http_request_seconds_total{{method="{_label(method)}",'
                f'route="{_label(route)}"}} {total:.6f}'
            )
        if self._refusals is not None:
            lines += _refusal_lines(self._refusals)
        return "\n".join(lines) + "\n"


def _refusal_lines(refusals: RefusalLog) -> list[str]:
    stats = refusals.stats()
    lines = [
        "# HELP tenantkv_auth_refused_total Requests refused for want of a valid token (401).",
        "# TYPE tenantkv_auth_refused_total counter",
    ]
    for reason, count in sorted(stats.refused.items()):
        lines.append(f'tenantkv_auth_refused_total{{reason="{_label(reason)}"}} {count}')
    lines += [
        "# HELP tenantkv_auth_refused_folded_total 401s counted under 'other' (past the sources "
        "audited by address in their window).",
        "# TYPE tenantkv_auth_refused_folded_total counter",
        f"tenantkv_auth_refused_folded_total {stats.folded}",
        "# HELP tenantkv_auth_refusal_records_total Aggregate access.refused records written.",
        "# TYPE tenantkv_auth_refusal_records_total counter",
        f"tenantkv_auth_refusal_records_total {stats.records}",
        "# HELP tenantkv_auth_refusal_flush_errors_total Windows of 401s that could not be "
        "audited.",
        "# TYPE tenantkv_auth_refusal_flush_errors_total counter",
        f"tenantkv_auth_refusal_flush_errors_total {stats.flush_errors}",
    ]
    return lines


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


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
