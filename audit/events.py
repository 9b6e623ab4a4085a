"""What an audit event says, and the actions the cache records.

An :class:`AuditEvent` is the caller's description of one admin action or security-relevant
occurrence; ``AuditLog.append`` turns it into a hash-chained record. Fields are validated here,
when the event is built, so a malformed event fails at the call site before any transaction work
is done.

Each event lands in exactly one chain: ``"tenant:<name>@<incarnation>"`` when ``tenant`` is set
(``<incarnation>``: the first 16 hex digits of the tenant's immutable id, ``tenant_id``), else the
system chain ``"system"``. A tenant's chain outlives the tenant (its deletion is recorded in it),
but a tenant created again under the same name is another tenant and starts a chain of its own:
its admins must not read their predecessor's token ids, request ids or purge scopes. An event
about a tenant whose id is unknown (records written before incarnations existed, or about a name
that no longer exists) lands in ``"tenant:<name>"``.
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
INCARNATION_HEX: Final = 16  # "tenant:" + 128-character name + "@" + 16 fits the 160-char column
_INCARNATION = re.compile(r"[0-9a-f]{16}")

# Column widths of tkv_audit_records; checked here because PostgreSQL would abort the caller's
# whole transaction on an over-long value, and SQLite would silently keep it.
MAX_ACTOR = 256
MAX_ROLE = 64
MAX_TENANT = 128
MAX_ACTION = 64
MAX_TARGET = 512
MAX_REQUEST_ID = 128
_ACTION = re.compile(r"[a-z0-9][a-z0-9_.-]*")


def chain_for(tenant: str | None, tenant_id: bytes | None = None) -> str:
    """The chain an event about ``tenant`` (None: the system) is appended to: the chain of the
    incarnation ``tenant_id`` of that name when it is given."""
    if tenant is None:
        return SYSTEM_CHAIN
    if tenant_id is None:
        return TENANT_CHAIN_PREFIX + tenant
    return f"{TENANT_CHAIN_PREFIX}{tenant}@{tenant_id.hex()[:INCARNATION_HEX]}"


def is_chain_of(chain: str, tenant: str | None) -> bool:
    """Whether ``chain`` holds records about ``tenant``: its unbound chain or the chain of any
    of its incarnations (what an export of that tenant's name may contain)."""
    base = chain_for(tenant)
    if chain == base or tenant is None:
        return chain == base
    return chain.startswith(base + "@") and bool(_INCARNATION.fullmatch(chain[len(base) + 1 :]))


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
    #: The tenant's immutable id, which picks its incarnation's chain (see the module docstring).
    tenant_id: bytes | None = None

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
        if self.tenant_id is not None and (
            self.tenant is None or not isinstance(self.tenant_id, bytes) or not self.tenant_id
        ):
            raise AuditRequestError("tenant_id needs a tenant and must be non-empty bytes")

    @property
    def chain(self) -> str:
        return chain_for(self.tenant, self.tenant_id)


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
        tenant_id: bytes | None = None,
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
            tenant_id=tenant_id,
        )
