"""Security incidents of the data plane: logged, counted and audited in one call.

A segment that fails to open, a refused over-quota store: each is a security event
(:mod:`tenantkv.security_events` keeps the counters and the recent list) and an audit record on
the tenant's chain. Recording never raises: the serving path must not fail because the audit
write did.
"""

from __future__ import annotations

import logging

from ..audit import FAILURE, Attribution, AuditLog
from ..index.database import Database
from ..security_events import SecurityEventLog

logger = logging.getLogger("tenantkv")


class SecurityIncidents:
    def __init__(self, db: Database, audit: AuditLog, attribution: Attribution) -> None:
        self.log = SecurityEventLog()
        self._db = db
        self._audit = audit
        self._attribution = attribution

    def record(self, kind: str, tenant: str, detail: str, action: str) -> None:
        """Log, count and audit a data-plane security event."""
        self.log.record(kind, tenant, detail)
        try:
            with self._db.write() as session:
                self._audit.append(
                    session,
                    self._attribution.event(
                        tenant or None, action, outcome=FAILURE, details={"detail": detail[:500]}
                    ),
                )
        except Exception as err:
            logger.error("could not audit security event %s: %s", kind, err)
