"""Audit attribution: the cache's own audit records, written in the action's transaction,
name the API caller instead of the server process.

``tenantkv.tenants`` and ``TenantKV.retire_keys`` build their audit events with
``kv.audit_event(...)`` inside the transaction that makes the change. :class:`CallerView` is a
view of the cache whose ``audit_event`` fills in the caller's actor (``token:<id>``), role and
request id, and which delegates everything else to the cache; the server runs those functions
on it. So each state change has exactly one audit record, committed with the change, and that
record says who asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..audit import ACCESS_REFUSED, DENIED, SUCCESS, AuditEvent
from .auth import Principal

if TYPE_CHECKING:
    from ..cache import TenantKV


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

    def event(
        self,
        tenant: str | None,
        action: str,
        target: str = "",
        *,
        outcome: str = SUCCESS,
        details: Mapping[str, Any] | None = None,
    ) -> AuditEvent:
        return AuditEvent(
            actor=self.actor,
            role=self.role,
            tenant=tenant,
            action=action,
            target=target,
            outcome=outcome,  # type: ignore[arg-type]
            request_id=self.request_id,
            details=dict(details or {}),
        )


class CallerView:
    """The cache, as seen by one caller: audit events built through it name the caller."""

    def __init__(self, kv: TenantKV, caller: Caller) -> None:
        self._kv = kv
        self._caller = caller

    def audit_event(
        self,
        tenant: str | None,
        action: str,
        target: str = "",
        *,
        outcome: str = SUCCESS,
        details: Mapping[str, Any] | None = None,
    ) -> AuditEvent:
        return self._caller.event(tenant, action, target, outcome=outcome, details=details)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)


def as_caller(kv: TenantKV, caller: Caller) -> TenantKV:
    """``kv`` with the caller's identity on the audit records its tenant functions write."""
    return cast("TenantKV", CallerView(kv, caller))


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
        with kv.db.write() as session:
            kv.audit.append(session, event)
    except Exception as err:
        kv.log.error("could not audit a refused API call: %s", err)
