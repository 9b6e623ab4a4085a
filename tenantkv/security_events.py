"""Security events from the data plane (a failed open, a dropped extent).

For now they go to the ``tenantkv.security`` logger and to per-kind counters readable through
``TenantKV.security_events()``; the audit log records them once it exists.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

logger = logging.getLogger("tenantkv.security")


@dataclass(frozen=True)
class SecurityEvent:
    kind: str
    tenant: str
    detail: str
    at: float = field(default_factory=time.time)


class SecurityEventLog:
    """Thread-safe counters and a bounded list of recent events."""

    def __init__(self, keep: int = 1000) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._recent: list[SecurityEvent] = []
        self._keep = keep

    def record(self, kind: str, tenant: str, detail: str) -> SecurityEvent:
        event = SecurityEvent(kind, tenant, detail)
        with self._lock:
            self._counts[kind] += 1
            self._recent.append(event)
            del self._recent[: -self._keep]
        logger.warning("security event %s tenant=%s: %s", kind, tenant, detail)
        return event

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def recent(self) -> list[SecurityEvent]:
        with self._lock:
            return list(self._recent)
