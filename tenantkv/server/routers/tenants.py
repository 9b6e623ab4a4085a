"""``/v1/tenants``: lifecycle, quotas and retention, keys, usage, purge.

State changes call TenantKV's tenant methods with the caller's attribution, so that their audit
records (written in the change's transaction) name the caller.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from ...audit import ROLE_TENANT_ADMIN
from ...components.metering import UsageReport
from ...errors import TenantNotFoundError
from ...services.tenants import TenantInfo
from ...time_window import parse_instant
from ..caller import Caller
from ..dependencies import KV, Lister, TenantCaller, TenantOperator, refuse, require_roles
from ..errors import FORBIDDEN, ApiError
from .jobs import JobOut, accepted

router = APIRouter(prefix="/v1/tenants", tags=["tenants"])

MAX_QUOTA: Final = 2**62
Retention = Annotated[dict[str, float | str], Field(max_length=32)]


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128)
    quota_bytes: int | None = Field(default=None, gt=0, le=MAX_QUOTA)
    retention: Retention | None = Field(
        default=None, description='class -> duration, e.g. {"agent": "3d", "chat": 86400}'
    )


class TenantUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    quota_bytes: int | None = Field(default=None, gt=0, le=MAX_QUOTA)
    retention: Retention | None = None


class TenantOut(BaseModel):
    name: str
    created_at: float
    key_version: int
    key_versions: list[int]
    quota_bytes: int
    used_bytes: int
    retention: dict[str, float]
    #: Which tenant of this name this is (new each time the name is created): what a gateway
    #: binds its tenant assertions to (``AssertionSigner.sign(incarnation=)``).
    incarnation: str

    @classmethod
    def of(cls, info: TenantInfo) -> TenantOut:
        return cls(
            name=info.name,
            created_at=info.created_at,
            key_version=info.key_version,
            key_versions=list(info.key_versions),
            quota_bytes=info.quota_bytes,
            used_bytes=info.used_bytes,
            retention=dict(info.retention or {}),
            incarnation=info.incarnation,
        )


class KeyRotation(BaseModel):
    key_version: int


class KeyRetirement(BaseModel):
    resealed: int
    dropped: int
    skipped_in_use: int
    retired_versions: list[int]
    extents_on_old_keys: int
    #: False when the destroyed keys may still be in the index's files (a reader's snapshot
    #: kept them); the next GC run retries (health counter scrub_pending).
    scrub_complete: bool


class UsageOut(BaseModel):
    tenant: str
    scope: str | None
    since: float | None
    until: float | None
    hit_tokens: int
    miss_tokens: int
    served_tokens: int
    served_bytes: int = Field(
        description="decoded bytes handed to the caller by full loads (tokens x layers x "
        "token_bytes of the namespace's layout)"
    )
    stored_tokens: int
    stored_bytes: int
    evicted_extents: int
    evicted_bytes: int
    expired_extents: int
    expired_bytes: int
    cost_units: float
    hit_ratio: float | None = Field(
        description="hit tokens over tokens looked up (None: no lookups in the window)"
    )


class PurgeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scope: str | None = Field(
        default=None, max_length=256, description='one scope ("" = tenant-wide); all if absent'
    )


class PurgeOut(BaseModel):
    extents: int
    bytes: int
    skipped_in_use: int


@router.post("", status_code=201, response_model=TenantOut)
def create_tenant(
    body: TenantCreate, kv: KV, caller: Annotated[Caller, Depends(require_roles("operator"))]
) -> TenantOut:
    info = kv.create_tenant(
        body.name, quota_bytes=body.quota_bytes, retention=body.retention, by=caller.attribution
    )
    return TenantOut.of(info)


@router.get("", response_model=list[TenantOut])
def list_tenants(kv: KV, caller: Lister) -> list[TenantOut]:
    if caller.role == ROLE_TENANT_ADMIN:
        own = caller.principal.tenant
        try:
            return [TenantOut.of(kv.get_tenant(own))] if own else []
        except TenantNotFoundError:
            return []
    return [TenantOut.of(info) for info in kv.list_tenants()]


@router.get("/{name}", response_model=TenantOut)
def get_tenant(name: str, kv: KV, caller: TenantCaller) -> TenantOut:
    return TenantOut.of(kv.get_tenant(name))


@router.patch("/{name}", response_model=TenantOut)
def update_tenant(
    name: str, body: TenantUpdate, request: Request, kv: KV, caller: TenantCaller
) -> TenantOut:
    """Quota (operators only: quotas reserve shared capacity) and/or retention."""
    if body.quota_bytes is not None and caller.role == ROLE_TENANT_ADMIN:
        refuse(request, kv, caller, "role")
        raise ApiError(403, dict(FORBIDDEN))
    info = kv.update_tenant(
        name, quota_bytes=body.quota_bytes, retention=body.retention, by=caller.attribution
    )
    return TenantOut.of(info)


@router.delete("/{name}", status_code=202, response_model=JobOut)
def delete_tenant(name: str, kv: KV, caller: TenantOperator) -> Response:
    """Crypto-shred the tenant, as a job (202; poll ``Location``). Its API tokens are revoked in
    the deletion's own transaction (as on every deletion path; the ``tenant.delete`` record
    counts them), so no token minted meanwhile survives and a tenant created again under this
    name inherits no admins."""
    return _job(kv, "tenant.delete", name, {}, caller)


@router.post("/{name}/keys/rotate", response_model=KeyRotation)
def rotate_keys(name: str, kv: KV, caller: TenantCaller) -> KeyRotation:
    return KeyRotation(key_version=kv.rotate_keys(name, by=caller.attribution))


@router.post("/{name}/keys/retire", status_code=202, response_model=JobOut)
def retire_keys(name: str, kv: KV, caller: TenantCaller) -> Response:
    """Re-seal extents on old key versions and destroy those versions, as a job (202); the
    job's ``result`` is a :class:`KeyRetirement`."""
    return _job(kv, "keys.retire", name, {}, caller)


TimeParam = Annotated[
    str | None,
    Query(
        max_length=64,
        description="ISO 8601 (UTC if no zone), epoch seconds, or a time ago (7d, 12h)",
    ),
]


def window(kv: KV, since: str | None, until: str | None) -> tuple[float | None, float | None]:
    """``since`` and ``until`` as seconds since the epoch (InvalidRequestError, a 422 naming
    the value, for anything else)."""
    now = kv.now()
    return (
        None if since is None else parse_instant(since, now),
        None if until is None else parse_instant(until, now),
    )


def usage_out(report: UsageReport) -> UsageOut:
    return UsageOut(
        tenant=report.tenant,
        scope=report.scope,
        since=report.since,
        until=report.until,
        cost_units=report.cost_units,
        hit_ratio=report.hit_ratio,
        **report.counters,
    )


@router.get("/{name}/usage", response_model=UsageOut)
def usage(
    name: str,
    kv: KV,
    caller: TenantCaller,
    since: TimeParam = None,
    until: TimeParam = None,
    scope: Annotated[str | None, Query(max_length=256)] = None,
) -> UsageOut:
    """Metering for buckets starting in [since, until); cost units price a miss at 1 per token
    and a token served from cache at the cache's ``hit_cost``. A window shorter than the
    metering resolution (60 s) is refused (422)."""
    start, end = window(kv, since, until)
    return usage_out(kv.usage(name, since=start, until=end, scope=scope))


@router.post("/{name}/purge", status_code=202, response_model=JobOut)
def purge_cache(
    name: str, kv: KV, caller: TenantCaller, body: PurgeRequest | None = None
) -> Response:
    """Drop the tenant's cached prefixes (one scope's if given), as a job (202); the tenant and
    keys stay. The job's ``result`` is a :class:`PurgeOut`."""
    scope = body.scope if body else None
    return _job(kv, "purge", name, {} if scope is None else {"scope": scope}, caller)


def _job(kv: KV, kind: str, name: str, params: dict[str, Any], caller: Caller) -> Response:
    info = kv.jobs.start(kind, name, params, by=caller.attribution)
    kv.jobs.run_in_background(info.id)
    return accepted(info)
