"""Operational counters of one process: what went wrong that is not a security event.

A lost extent (bytes gone or short) and an operation that degraded to a miss because the index
or block store failed are the operator's business, not an attack and not the tenant's bill:
they are counted here (and logged), while :mod:`tenantkv.security_events` keeps what may be
an attack.
"""

from __future__ import annotations

import threading
from collections import Counter

#: Names counted: ``lost_extents``; ``degraded_<operation>`` for lookup, cached_length,
#: store, load and prefetch; ``incomplete_scrubs`` (shredded keys that stayed in the index's
#: files for a while, see ``services/shredding.py``); ``engine_errors`` (an engine's call made a
#: miss by an error, ``integrations/engine_identity.py``); ``refusal_audit_failures`` (windows of
#: refused engine requests that could not be audited, ``incidents.py``).
LOST_EXTENTS = "lost_extents"
INCOMPLETE_SCRUBS = "incomplete_scrubs"
#: A level, not a count: 1 while shredded keys may still be in the index's files, 0 after.
SCRUB_PENDING = "scrub_pending"


class HealthCounters:
    """Thread-safe counters by name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def set(self, name: str, value: int) -> None:
        """Set a level (such as ``scrub_pending``) rather than add to a count."""
        with self._lock:
            self._counts[name] = value

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
