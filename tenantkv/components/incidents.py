"""Security incidents of the data plane: logged, counted and audited.

A segment that fails to open, a refused over-quota store: each is a security event
(:mod:`tenantkv.security_events` keeps the counters and the recent list) and an audit record on
the tenant's chain, written at once. Recording never raises: the serving path must not fail
because the audit write did.

A serving engine's refused request (no valid tenant assertion: :meth:`SecurityIncidents.refused`)
costs its sender nothing, so it is not written at once: it is counted (security events, metrics),
logged at most once per kind per minute, and aggregated per kind and time window
(``refusal_windows.py``); a thread of its own writes each window's records as the window ends,
and :meth:`SecurityIncidents.close` the last one. The engine's thread (vLLM's scheduler) never
takes the index's write lock for a refusal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final

from ..audit import ACCESS_REFUSED, DENIED, FAILURE, Attribution, AuditEvent, AuditLog
from ..index.database import Database
from ..security_events import SecurityEventLog
from .refusal_windows import RefusalWindow, RefusalWindows, WindowWriter

logger = logging.getLogger("tenantkv")

#: Refused engine requests are audited as one record per kind per this many seconds.
REFUSAL_WINDOW_SECONDS: Final = 60.0
#: Kinds audited by name per window (there are few; the rest are counted as ``other``).
MAX_REFUSAL_KINDS: Final = 16
#: The health counter of windows of refusals that could not be audited.
REFUSAL_AUDIT_FAILURES: Final = "refusal_audit_failures"


class SecurityIncidents:
    def __init__(
        self,
        db: Database,
        audit: AuditLog,
        attribution: Attribution,
        *,
        clock: Callable[[], float],
        on_refusal_audit_failure: Callable[[], None] | None = None,
        refusal_window_seconds: float = REFUSAL_WINDOW_SECONDS,
    ) -> None:
        self.log = SecurityEventLog()
        self._db = db
        self._audit = audit
        self._attribution = attribution
        self.refusals = RefusalWindows(
            self._write,
            self._refusal_records,
            window_seconds=refusal_window_seconds,
            max_keys=MAX_REFUSAL_KINDS,
            clock=clock,
            what="refused engine requests",
            on_flush_error=on_refusal_audit_failure,
        )
        self._writer = WindowWriter(self.refusals, name="tenantkv-refusals")

    def record(self, kind: str, tenant: str, detail: str, action: str) -> None:
        """Log, count and audit a data-plane security event."""
        self.log.record(kind, tenant, detail)
        try:
            self._write(
                [
                    self._attribution.event(
                        tenant or None, action, outcome=FAILURE, details={"detail": detail[:500]}
                    )
                ]
            )
        except Exception as err:
            logger.error("could not audit security event %s: %s", kind, err)

    def refused(self, kind: str, reason: str, detail: str) -> None:
        """Count a refused request (``kind``, for ``reason``), log it within the rate limit,
        and leave its audit record to the window's writer: no index access here."""
        self.log.record(kind, "", detail, rate_limited=True)
        if self.refusals.count(kind, reason):
            self._writer.wake()

    def close(self) -> None:
        """Stop the refusals' writer and audit every refusal still counted (before the index
        closes)."""
        self._writer.close()

    def _write(self, events: Sequence[AuditEvent]) -> None:
        with self._db.write() as session:
            for event in events:
                self._audit.append(session, event)

    def _refusal_records(self, window: RefusalWindow) -> list[AuditEvent]:
        """One ``access.refused`` record per kind: its count, by reason, in the window. The
        refused requests' claimed tenants are not believed, so the records go to the system
        chain; their request ids (the engine's or the client's) are not kept."""
        return [
            self._attribution.event(
                None,
                ACCESS_REFUSED,
                kind,
                outcome=DENIED,
                details={"kind": kind, **window.details(entry)},
            )
            for kind, entry in sorted(window.keys.items())
        ]
