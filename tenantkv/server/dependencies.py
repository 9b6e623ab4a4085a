"""FastAPI dependencies: the cache, the settings, the caller, and role/tenant guards.

Use the ``Annotated`` aliases in routes::

    def get_tenant(name: str, kv: KV, caller: TenantAdminOrOperator) -> ...

Guards decide in this order: no valid token -> 401; a tenant-admin naming a tenant other than
its own -> the same 404 a missing tenant gets (whether or not that tenant exists, which the
guard never looks up); a role the route does not allow -> 403. Every refusal is audited: a 403
or 404 per request (the caller is known), a 401 per source and time window (``refusals.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..api import TenantKV
from ..audit import ROLE_AUDITOR, ROLE_OPERATOR, ROLE_TENANT_ADMIN
from ..services.tokens import AuthError, Principal, Role
from .caller import Caller, audit_refusal
from .errors import FORBIDDEN, UNAUTHORIZED, ApiError, not_found
from .gate import PRINCIPAL_KEY, source_of
from .metrics import Metrics, request_id_of
from .refusals import RefusalLog
from .settings import Settings

_bearer = HTTPBearer(auto_error=False, description="an admin API token, tkv_...")


def get_kv(request: Request) -> TenantKV:
    kv: TenantKV = request.app.state.kv
    return kv


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


KV = Annotated[TenantKV, Depends(get_kv)]
AppSettings = Annotated[Settings, Depends(get_settings)]
AppMetrics = Annotated[Metrics, Depends(get_metrics)]


def _route(request: Request) -> str:
    route: Any = request.scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


def refuse(request: Request, kv: TenantKV, caller: Caller, reason: str) -> None:
    """Audit a refusal of an authenticated caller, on its own chain (tenant-admin) or the
    system chain."""
    audit_refusal(
        kv,
        actor=caller.actor,
        role=caller.role,
        tenant=caller.principal.tenant if caller.role == ROLE_TENANT_ADMIN else None,
        request_id=caller.request_id,
        reason=reason,
        method=request.method,
        route=_route(request),
    )


Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def caller_of(
    request: Request, kv: TenantKV, credentials: HTTPAuthorizationCredentials | None
) -> Caller:
    """The caller a bearer token authenticates; 401 (counted in the RefusalLog) otherwise."""
    request_id = request_id_of(request.scope)
    principal = request.scope.get(PRINCIPAL_KEY)  # what the AuthGate authenticated
    if isinstance(principal, Principal):
        return Caller(principal, request_id)
    try:
        principal = kv.tokens.authenticate(credentials.credentials if credentials else None)
    except AuthError as err:
        # Counted, and audited per source and window: not one record per anonymous request.
        refusals: RefusalLog = request.app.state.refusals
        refusals.count(source_of(request.scope), err.reason, err.token_id)
        raise ApiError(401, dict(UNAUTHORIZED), {"WWW-Authenticate": "Bearer"}) from None
    return Caller(principal, request_id)


def authenticate(request: Request, kv: KV, credentials: Credentials) -> Caller:
    return caller_of(request, kv, credentials)


def check_role(request: Request, kv: TenantKV, caller: Caller, roles: tuple[Role, ...]) -> Caller:
    if caller.principal.role not in roles:
        refuse(request, kv, caller, "role")
        raise ApiError(403, dict(FORBIDDEN))
    return caller


Authenticated = Annotated[Caller, Depends(authenticate)]


def require_roles(*roles: Role) -> Callable[..., Caller]:
    """A dependency admitting callers with one of ``roles`` (others: 403)."""

    def dependency(request: Request, kv: KV, caller: Authenticated) -> Caller:
        return check_role(request, kv, caller, roles)

    return dependency


def tenant_access(*, tenant_admin: bool) -> Callable[..., Caller]:
    """A dependency for ``/v1/tenants/{name}/...``: operators always; a tenant-admin only for
    its own tenant (another name: 404, as if it did not exist) and only if ``tenant_admin``
    (its own tenant on an operator-only route: 403); auditors never (403)."""

    def dependency(name: str, request: Request, kv: KV, caller: Authenticated) -> Caller:
        role = caller.principal.role
        if role == ROLE_OPERATOR:
            return caller
        if role == ROLE_TENANT_ADMIN:
            if name != caller.principal.tenant:
                refuse(request, kv, caller, "other-tenant")
                raise not_found()
            if tenant_admin:
                return caller
        refuse(request, kv, caller, "role")
        raise ApiError(403, dict(FORBIDDEN))

    return dependency


Operator = Annotated[Caller, Depends(require_roles(ROLE_OPERATOR))]
AnyRole = Annotated[Caller, Depends(require_roles(ROLE_OPERATOR, ROLE_TENANT_ADMIN, ROLE_AUDITOR))]
AuditReader = Annotated[
    Caller, Depends(require_roles(ROLE_OPERATOR, ROLE_AUDITOR, ROLE_TENANT_ADMIN))
]
MetricsReader = Annotated[Caller, Depends(require_roles(ROLE_OPERATOR, ROLE_AUDITOR))]
#: Operators and tenant-admins (what a route then shows a tenant-admin is its own tenant's only).
Lister = Annotated[Caller, Depends(require_roles(ROLE_OPERATOR, ROLE_TENANT_ADMIN))]
TenantCaller = Annotated[Caller, Depends(tenant_access(tenant_admin=True))]
TenantOperator = Annotated[Caller, Depends(tenant_access(tenant_admin=False))]
