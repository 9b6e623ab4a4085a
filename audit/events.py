"""What an audit event says, and the actions the cache records.

An :class:`AuditEvent` is the caller's description of one admin action or security-relevant
occurrence; ``AuditLog.append`` turns it into a hash-chained record. Fields are validated here,
when the event is built, so a malformed event fails at the call site before any transaction work
is done.

Each event lands in exactly one chain: ``"tenant:<name>"`` when ``tenant`` is set, else the system
chain ``"system"``. A tenant's chain outlives the tenant (its deletion is recorded in it) and
continues if the name is created again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from .canonical import normalise_details, to_microseconds
from .errors import AuditRequestError

# ---- actions the cache records -----------------------------------------------------------------
TENANT_CREATE: Final = "tenant.create"
TENANT_UPDATE: Final = "tenant.update"
TENANT_DELETE: Final = "tenant.delete"
KEYS_ROTATE: Final = "keys.rotate"
KEYS_RETIRE: Final = "keys.retire"
QUOTA_REFUSED: Final = "quota.refused"
SEGMENT_OPEN_FAILED: Final = "segment.open_failed"
ACCESS_REFUSED: Final = "access.refused"
USAGE_SUMMARY: Final = "usage.summary"
AUDIT_EXPORT: Final = "audit.export"
AUDIT_PURGE: Final = "audit.purge"  # written by AuditLog.purge_expired itself

ACTIONS: Final = frozenset(
    {
        TENANT_CREATE,
        TENANT_UPDATE,
        TENANT_DELETE,
        KEYS_ROTATE,
        KEYS_RETIRE,
        QUOTA_REFUSED,
        SEGMENT_OPEN_FAILED,
        ACCESS_REFUSED,
        USAGE_SUMMARY,
        AUDIT_EXPORT,
        AUDIT_PURGE,
    }
)

# ---- outcomes and roles ------------------------------------------------------------------------
Outcome = Literal["success", "failure", "denied"]
SUCCESS: Final = "success"
FAILURE: Final = "failure"
DENIED: Final = "denied"
OUTCOMES: Final = frozenset({SUCCESS, FAILURE, DENIED})

ROLE_OPERATOR: Final = "operator"
ROLE_TENANT_ADMIN: Final = "tenant-admin"
ROLE_AUDITOR: Final = "auditor"
ROLE_SYSTEM: Final = "system"  # the cache acting on its own (retention, integrity checks)

SYSTEM_CHAIN: Final = "system"
TENANT_CHAIN_PREFIX: Final = "tenant:"

# Column widths of tkv_audit_records; checked here because PostgreSQL would abort the caller's
# whole transaction on an over-long value, and SQLite would silently keep it.
MAX_ACTOR = 256
MAX_ROLE = 64
MAX_TENANT = 128
MAX_ACTION = 64
MAX_TARGET = 512
MAX_REQUEST_ID = 128
_ACTION = re.compile(r"[a-z0-9][a-z0-9_.-]*")


def chain_for(tenant: str | None) -> str:
    """The chain an event about ``tenant`` (None: the system) is appended to."""
    return SYSTEM_CHAIN if tenant is None else TENANT_CHAIN_PREFIX + tenant


def _check_text(name: str, value: object, limit: int, *, empty: bool = False) -> None:
    if not isinstance(value, str):
        raise AuditRequestError(f"{name} must be a string, got {type(value).__name__}")
    if not value and not empty:
        raise AuditRequestError(f"{name} must not be empty")
    if len(value) > limit:
        raise AuditRequestError(f"{name} is {len(value)} characters; the limit is {limit}")
    if "\x00" in value:  # PostgreSQL text cannot hold NUL
        raise AuditRequestError(f"{name} must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise AuditRequestError(f"{name} is not encodable as UTF-8") from None


def check_tenant(tenant: object) -> None:
    """Refuse a tenant name no record could carry (also used to check export requests)."""
    _check_text("tenant", tenant, MAX_TENANT)


@dataclass(frozen=True, kw_only=True)
class AuditEvent:
    """One auditable occurrence, as the caller describes it.

    ``tenant`` has no default on purpose: forgetting it would file a tenant's event in the
    system chain, so system events say ``tenant=None`` explicitly. ``time`` (seconds since the
    epoch) defaults to the log's clock at append time.
    """

    actor: str
    role: str
    tenant: str | None
    action: str
    target: str = ""
    outcome: Outcome = "success"
    request_id: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    time: float | None = None

    def __post_init__(self) -> None:
        _check_text("actor", self.actor, MAX_ACTOR)
        _check_text("role", self.role, MAX_ROLE)
        if self.tenant is not None:
            check_tenant(self.tenant)
        _check_text("action", self.action, MAX_ACTION)
        if not _ACTION.fullmatch(self.action):
            raise AuditRequestError(
                f"action {self.action!r} must be lowercase letters, digits, '.', '_' or '-'"
            )
        _check_text("target", self.target, MAX_TARGET, empty=True)
        if self.outcome not in OUTCOMES:
            raise AuditRequestError(
                f"outcome {self.outcome!r} must be one of {', '.join(sorted(OUTCOMES))}"
            )
        if self.request_id is not None:
            _check_text("request_id", self.request_id, MAX_REQUEST_ID)
        normalise_details(self.details)  # refuse what cannot be hashed exactly, now
        if self.time is not None:
            to_microseconds(self.time)

    @property
    def chain(self) -> str:
        return chain_for(self.tenant)


@dataclass(frozen=True)
class Attribution:
    """Who takes an action: the actor, its role and (for API calls) the request id.

    Actions are recorded with the attribution of whoever asked for them -- the embedding
    process for direct Python calls, the authenticated caller for the admin service -- so the
    code that performs an action takes one of these rather than knowing who its callers are.
    """

    actor: str
    role: str
    request_id: str | None = None

    def event(
        self,
        tenant: str | None,
        action: str,
        target: str = "",
        *,
        outcome: Outcome = "success",
        details: Mapping[str, Any] | None = None,
    ) -> AuditEvent:
        return AuditEvent(
            actor=self.actor,
            role=self.role,
            tenant=tenant,
            action=action,
            target=target,
            outcome=outcome,
            request_id=self.request_id,
            details=dict(details or {}),
        )
