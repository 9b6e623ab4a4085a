"""The gateway's settings: limits, timeouts, concurrency, the audience and the assertion lifetime.

A frozen dataclass checked as it is made, so that a gateway never starts with a limit that
switches itself off (a zero or NaN timeout, an unbounded body): every field is finite and
within bounds, and the error names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from ..errors import InvalidRequestError
from ..tenant_assertion import MAX_LIFETIME_LIMIT, check_seconds

_MiB: Final = 1024 * 1024
#: The smallest gateway secret accepted (it keys the cache salt and the affinity digest).
MIN_SECRET_BYTES: Final = 32
_MAX_LABEL: Final = 256


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(
            f"{name} must be a whole number from {low} to {high}, got {value!r}"
        )
    return value


@dataclass(frozen=True)
class GatewaySettings:
    """What a gateway is allowed to do. ``audience`` names the deployment: the nodes' verifiers
    must be configured with the same one, so an assertion minted here is refused elsewhere."""

    audience: str
    #: Lifetime of each signed assertion, seconds (short: it is a bearer token until it expires).
    assertion_lifetime: float = 60.0
    #: Largest request body accepted (413 beyond).
    max_body_bytes: int = 1 * _MiB
    #: Largest non-streamed upstream answer read (502 beyond).
    max_response_bytes: int = 16 * _MiB
    #: Requests in flight per inference key (429 beyond).
    max_concurrency_per_key: int = 16
    #: Upstream connections the gateway holds open at most (all backends together).
    max_connections: int = 512
    #: Seconds to connect to a backend before it counts as failed (then the next is tried).
    connect_timeout: float = 2.0
    #: Seconds an upstream may stay silent (before its answer, or between streamed chunks): 504.
    upstream_timeout: float = 120.0
    #: Seconds a backend's ``/health`` may take for ``/readyz``.
    health_timeout: float = 1.0
    #: Seconds a backend that refused a connection is ranked last.
    backend_cooldown: float = 5.0
    #: How much of the prompt's beginning the affinity digest reads: characters, and messages.
    affinity_chars: int = 512
    affinity_messages: int = 2

    def __post_init__(self) -> None:
        if (
            not isinstance(self.audience, str)
            or not self.audience
            or len(self.audience) > _MAX_LABEL
            or not self.audience.isprintable()
        ):
            raise InvalidRequestError(
                f"audience must be a printable string of 1-{_MAX_LABEL} chars, "
                f"got {self.audience!r}"
            )
        # whole seconds, at least 1 (an assertion's exp and iat are whole seconds)
        check_seconds(
            "assertion_lifetime", self.assertion_lifetime, minimum=1.0, maximum=MAX_LIFETIME_LIMIT
        )
        _check_int("max_body_bytes", self.max_body_bytes, 1024, 64 * _MiB)
        _check_int("max_response_bytes", self.max_response_bytes, 1024, 1024 * _MiB)
        _check_int("max_concurrency_per_key", self.max_concurrency_per_key, 1, 100_000)
        _check_int("max_connections", self.max_connections, 1, 100_000)
        _check_int("affinity_chars", self.affinity_chars, 1, 1_000_000)
        _check_int("affinity_messages", self.affinity_messages, 1, 10_000)
        check_seconds(
            "connect_timeout", self.connect_timeout, minimum=0.0, maximum=600.0, open_minimum=True
        )
        check_seconds(
            "upstream_timeout",
            self.upstream_timeout,
            minimum=0.0,
            maximum=86_400.0,
            open_minimum=True,
        )
        check_seconds(
            "health_timeout", self.health_timeout, minimum=0.0, maximum=600.0, open_minimum=True
        )
        check_seconds("backend_cooldown", self.backend_cooldown, minimum=0.0, maximum=3600.0)


def check_backends(urls: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The backend base URLs, each ``http(s)://host[:port][/path]`` without a query, fragment
    or credentials, trailing ``/`` removed; at least one, no duplicates."""
    if isinstance(urls, str) or not urls:
        raise InvalidRequestError("a gateway needs at least one backend URL")
    checked: list[str] = []
    for url in urls:
        parts = urlsplit(url) if isinstance(url, str) else None
        if (
            parts is None
            or parts.scheme not in ("http", "https")
            or not parts.hostname
            or parts.query
            or parts.fragment
            or parts.username is not None
            or not url.isprintable()
        ):
            raise InvalidRequestError(f"not a backend URL (http(s)://host[:port][/path]): {url!r}")
        base = url.rstrip("/")
        if base in checked:
            raise InvalidRequestError(f"backend listed twice: {url!r}")
        checked.append(base)
    return tuple(checked)


def check_secret(secret: bytes) -> bytes:
    """The gateway secret: bytes, at least ``MIN_SECRET_BYTES`` long."""
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise InvalidRequestError(f"the gateway secret must be at least {MIN_SECRET_BYTES} bytes")
    return secret
