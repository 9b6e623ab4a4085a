"""API tokens: a tenant's admins (``/v1/tenants/{name}/tokens``) and every token (``/v1/tokens``,
operators only). A token is returned once, at creation; listings show ids and metadata only."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response
from pydantic import BaseModel, ConfigDict, Field

from ...audit import ROLE_TENANT_ADMIN
from ...errors import InvalidRequestError
from ...services.tokens import AuthError, Role, TokenInfo
from ..caller import Caller
from ..dependencies import KV, AnyRole, AppSettings, Operator, TenantCaller
from ..errors import UNAUTHORIZED, ApiError
from ..settings import Settings

router = APIRouter(tags=["tokens"])

TokenId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")]
_NO_TOKEN = {"error": "not_found", "detail": "no such token"}


class TenantTokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttl_seconds: float | None = Field(default=None, gt=0, le=366 * 86400, allow_inf_nan=False)
    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]*$",
        description="what the token is for (listings, whoami)",
    )


class TokenCreate(TenantTokenCreate):
    role: Role
    tenant: str | None = Field(default=None, min_length=1, max_length=128)


class TokenCreated(BaseModel):
    token: str = Field(description="shown once; only its hash is kept")
    token_id: str
    role: Role
    tenant: str | None
    expires_at: float | None
    name: str | None = None


class TokenOut(BaseModel):
    id: str
    role: Role
    tenant: str | None
    created_at: float
    created_by: str
    expires_at: float | None
    revoked_at: float | None
    minted_by: str | None = Field(default=None, description="id of the token that minted it")
    name: str | None = None

    @classmethod
    def of(cls, info: TokenInfo) -> TokenOut:
        return cls(**info.__dict__)


class WhoAmI(BaseModel):
    token_id: str
    name: str | None
    role: Role
    tenant: str | None
    expires_at: float | None


def _ttl(settings: Settings, caller: Caller, kv: KV, asked: float | None) -> float | None:
    """The token's lifetime: as asked (default ``default_token_ttl_seconds``), at most
    ``max_token_ttl_seconds``, and for a tenant-admin never past its own token's expiry (a
    tenant-admin cannot outlive its own credential by minting new ones)."""
    ttl = settings.default_token_ttl_seconds if asked is None else asked
    if ttl is not None and ttl > settings.max_token_ttl_seconds:
        raise InvalidRequestError(
            f"ttl_seconds may be at most {int(settings.max_token_ttl_seconds)}"
        )
    return kv.tokens.bounded_ttl(caller.principal, ttl, settings.max_token_ttl_seconds)


def _create(
    kv: KV, caller: Caller, role: Role, tenant: str | None, ttl: float | None, name: str | None
) -> TokenCreated:
    try:
        issued = kv.tokens.issue(
            role, tenant, ttl, by=caller.attribution, minter=caller.principal, name=name
        )
    except AuthError:  # the caller's token (or a minter's) was revoked since it was checked
        raise ApiError(401, dict(UNAUTHORIZED), {"WWW-Authenticate": "Bearer"}) from None
    return TokenCreated(
        token=issued.token,
        token_id=issued.info.id,
        role=role,
        tenant=tenant,
        expires_at=issued.info.expires_at,
        name=issued.info.name,
    )


@router.post("/v1/tenants/{name}/tokens", status_code=201, response_model=TokenCreated)
def create_tenant_token(
    name: str,
    kv: KV,
    settings: AppSettings,
    caller: TenantCaller,
    body: TenantTokenCreate | None = None,
) -> TokenCreated:
    """A new tenant-admin token for this tenant (operators, or this tenant's admins)."""
    ttl = _ttl(settings, caller, kv, body.ttl_seconds if body else None)
    return _create(kv, caller, ROLE_TENANT_ADMIN, name, ttl, body.name if body else None)


@router.get("/v1/tenants/{name}/tokens", response_model=list[TokenOut])
def list_tenant_tokens(name: str, kv: KV, caller: TenantCaller) -> list[TokenOut]:
    kv.get_tenant(name)  # a missing tenant is a 404, not an empty list
    return [TokenOut.of(info) for info in kv.tokens.listing(name)]


@router.delete("/v1/tenants/{name}/tokens/{token_id}", status_code=204)
def revoke_tenant_token(name: str, token_id: TokenId, kv: KV, caller: TenantCaller) -> Response:
    kv.get_tenant(name)
    if not kv.tokens.revoke(token_id, by=caller.attribution, tenant=name):
        raise ApiError(404, dict(_NO_TOKEN))
    return Response(status_code=204)


@router.post("/v1/tokens", status_code=201, response_model=TokenCreated)
def create_token(
    body: TokenCreate, kv: KV, settings: AppSettings, caller: Operator
) -> TokenCreated:
    """A token of any role (operators only)."""
    ttl = _ttl(settings, caller, kv, body.ttl_seconds)
    return _create(kv, caller, body.role, body.tenant, ttl, body.name)


@router.get("/v1/tokens", response_model=list[TokenOut])
def list_all_tokens(kv: KV, caller: Operator) -> list[TokenOut]:
    return [TokenOut.of(info) for info in kv.tokens.listing()]


@router.delete("/v1/tokens/{token_id}", status_code=204)
def revoke_token(token_id: TokenId, kv: KV, caller: Operator) -> Response:
    if not kv.tokens.revoke(token_id, by=caller.attribution):
        raise ApiError(404, dict(_NO_TOKEN))
    return Response(status_code=204)


@router.get("/v1/whoami", response_model=WhoAmI)
def whoami(kv: KV, caller: AnyRole) -> WhoAmI:
    """The calling token: its id, name, role, tenant and expiry (any role)."""
    info = kv.tokens.describe(caller.principal.token_id)
    return WhoAmI(
        token_id=caller.principal.token_id,
        name=None if info is None else info.name,
        role=caller.principal.role,
        tenant=caller.principal.tenant,
        expires_at=caller.principal.expires_at,
    )
