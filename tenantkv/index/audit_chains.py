"""The audit log as the cache uses it: each tenant event filed on its tenant's incarnation.

``tenantkv.audit`` knows tenants by name only (it is a leaf package and never reads the cache's
tables), so an event names its incarnation with ``tenant_id``. Most callers know only the name;
rather than make each of them look the id up, this log looks it up in the caller's own
transaction, where the tenant row is as the action sees it. Callers that act on a tenant that may
be gone or replaced by then (revoking an old token, deleting the tenant) pass ``tenant_id``
themselves.
"""

from __future__ import annotations

import dataclasses

from sqlalchemy.orm import Session

from ..audit import AuditEvent, AuditLog, AuditRecord, chain_for
from . import tenants as tenant_rows


class TenantAuditLog(AuditLog):
    """An :class:`AuditLog` that fills in ``tenant_id`` from the tenant's current row."""

    def append(self, session: Session, event: AuditEvent) -> AuditRecord:
        if isinstance(event, AuditEvent) and event.tenant is not None and event.tenant_id is None:
            tenant_id = tenant_rows.id_of(session, event.tenant)
            if tenant_id is not None:
                event = dataclasses.replace(event, tenant_id=tenant_id)
        return super().append(session, event)


def incarnation_chain(session: Session, tenant: str) -> str | None:
    """The chain of the tenant named ``tenant`` as it exists now (None: no such tenant)."""
    tenant_id = tenant_rows.id_of(session, tenant)
    return None if tenant_id is None else chain_for(tenant, tenant_id)
