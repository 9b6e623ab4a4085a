"""Audit attribution: the records of an API call name the caller, not the server process.

TenantKV's tenant methods take an :class:`~tenantkv.audit.Attribution` and write their audit
record in the transaction that makes the change; the routers pass ``caller.attribution``. So
each state change has exactly one audit record, committed with the change, and that record says
who asked.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..audit import ACCESS_REFUSED, DENIED, SUCCESS, Attribution, AuditEvent, Outcome
from ..services.tokens import Principal

if TYPE_CHECKING:
    from ..api import TenantKV


@dataclass(frozen=True)
class Caller:
    """The authenticated principal of one request, with that request's id."""

    principal: Principal
    request_id: str

    @property
    def actor(self) -> str:
        return self.principal.actor

    @property
    def role(self) -> str:
        return self.principal.role

    @property
    def attribution(self) -> Attribution:
        return Attribution(self.actor, self.role, self.request_id)

    def event(
        self,
        tenant: str | None,
        action: str,
        target: str = "",
        *,
        outcome: Outcome = SUCCESS,
        details: Mapping[str, Any] | None = None,
    ) -> AuditEvent:
        return self.attribution.event(tenant, action, target, outcome=outcome, details=details)


def audit_refusal(
    kv: TenantKV,
    *,
    actor: str,
    role: str,
    tenant: str | None,
    request_id: str,
    reason: str,
    method: str,
    route: str,
) -> None:
    """Record a refused call (``access.refused``). ``tenant`` is the *caller's own* tenant
    (None: the system chain), never the one asked about, so the record reveals nothing about
    whether that one exists. Never raises: a failed audit write must not turn a refusal into a
    500 (it is logged)."""
    try:
        event = AuditEvent(
            actor=actor,
            role=role,
            tenant=tenant,
            action=ACCESS_REFUSED,
            target=route[:512],
            outcome=DENIED,
            request_id=request_id,
            details={"reason": reason, "method": method},
        )
        kv.audit.record(event)
    except Exception as err:
        logging.getLogger("tenantkv").error("could not audit a refused API call: %s", err)
