"""Security events from the data plane (a failed open, a dropped extent, a refused request).

They go to the ``tenantkv.security`` logger and to per-kind counters readable through
``TenantKV.security_events()`` (and the ``tenantkv_security_events_total`` metric); the
components audit them (``components/incidents.py``).

A kind that anyone can provoke at no cost (a serving engine's request without a valid tenant
assertion) is logged through a :class:`LogLimiter`: one line per kind per interval, the next one
saying how many were left out. Counters and the recent list still see every event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("tenantkv.security")

#: Seconds between two log lines of one rate-limited kind.
LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class SecurityEvent:
    kind: str
    tenant: str
    detail: str
    at: float = field(default_factory=time.time)


class LogLimiter:
    """At most one log line per key per ``interval`` seconds (of ``clock``, monotonic by
    default); a line that is let through says how many of its key were left out before it.

    Why: 2,000 refused requests wrote 2,000 WARNING lines from vLLM's scheduler thread. The
    limit is per key, so one flooding kind does not silence another."""

    def __init__(
        self, interval: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._left_out: Counter[str] = Counter()

    def allow(self, key: str) -> int | None:
        """None: leave this line out (it is counted). Else log it, with the returned count of
        the key's lines left out since its last line."""
        now = self._clock()
        with self._lock:
            if now < self._next.get(key, -float("inf")):
                self._left_out[key] += 1
                return None
            self._next[key] = now + self._interval
            return self._left_out.pop(key, 0)


class SecurityEventLog:
    """Thread-safe counters and a bounded list of recent events."""

    def __init__(self, keep: int = 1000) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._recent: list[SecurityEvent] = []
        self._keep = keep
        self._limiter = LogLimiter()

    def record(
        self, kind: str, tenant: str, detail: str, *, rate_limited: bool = False
    ) -> SecurityEvent:
        """Count and keep the event, and log it (``rate_limited``: through the limiter)."""
        event = SecurityEvent(kind, tenant, detail)
        with self._lock:
            self._counts[kind] += 1
            self._recent.append(event)
            del self._recent[: -self._keep]
        left_out = self._limiter.allow(kind) if rate_limited else 0
        if left_out is None:
            return event
        if left_out:
            logger.warning(
                "security event %s tenant=%s: %s (and %d more not logged since the last line)",
                kind,
                tenant,
                detail,
                left_out,
            )
        else:
            logger.warning("security event %s tenant=%s: %s", kind, tenant, detail)
        return event

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def recent(self) -> list[SecurityEvent]:
        with self._lock:
            return list(self._recent)
