"""Authentication before anything else (a pure ASGI middleware).

The routes authenticate through dependencies, and the framework resolves a route's body before
its dependencies: an anonymous caller could make the server read and parse a body of any size
before being told it has no token. The gate runs first: on every path but the public ones it
checks the bearer token and, without a valid one, answers the API's 401 (same body, same
``WWW-Authenticate``) without reading a byte of the body. The refusal is counted in the
:class:`~tenantkv.server.refusals.RefusalLog`, not audited one record per request.

The principal it authenticated travels in the ASGI scope (:data:`PRINCIPAL_KEY`), so the
route's dependencies do not look the token up a second time; they still authenticate whatever
reaches them without one (the gate is defence in front of them, not instead of them).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Final

from fastapi.security.utils import get_authorization_scheme_param
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import TenantKVError
from ..services.tokens import AuthError, Principal
from .errors import UNAUTHORIZED
from .refusals import RefusalLog

if TYPE_CHECKING:
    from ..api import TenantKV

logger = logging.getLogger("tenantkv.server")

PRINCIPAL_KEY: Final = "tenantkv.principal"
UNAVAILABLE: Final = {"error": "unavailable", "detail": "the cache is unavailable"}


def bearer_token(scope: Scope) -> str | None:
    """The credentials of an ``Authorization: Bearer ...`` header, as FastAPI's ``HTTPBearer``
    reads them (None: no such header)."""
    scheme, credentials = get_authorization_scheme_param(Headers(scope=scope).get("authorization"))
    if not scheme or not credentials or scheme.lower() != "bearer":
        return None
    return credentials


def source_of(scope: Scope) -> str | None:
    client = scope.get("client")
    return str(client[0]) if client else None


def unauthorized() -> JSONResponse:
    return JSONResponse(dict(UNAUTHORIZED), status_code=401, headers={"WWW-Authenticate": "Bearer"})


class AuthGate:
    """Answer 401 to requests without a valid token on every path but ``public`` ones, before
    the application (and the body) is touched."""

    def __init__(
        self,
        app: ASGIApp,
        kv: TenantKV,
        refusals: RefusalLog,
        public: Collection[str],
        routes: Sequence[BaseRoute],
    ) -> None:
        self.app = app
        self.kv = kv
        self.refusals = refusals
        self.public = frozenset(public)
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.public:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        try:
            principal = await run_in_threadpool(self._authenticate, token, source_of(scope))
        except TenantKVError as err:  # the index did not answer (CacheUnavailableError)
            logger.warning("could not check an API token: %s", err)
            await JSONResponse(dict(UNAVAILABLE), status_code=503)(scope, receive, send)
            return
        if principal is None:
            self._label(scope)
            await unauthorized()(scope, receive, send)
            return
        scope[PRINCIPAL_KEY] = principal
        await self.app(scope, receive, send)

    def _authenticate(self, token: str | None, source: str | None) -> Principal | None:
        """The token's principal; None (the refusal counted) if it authenticates nobody."""
        try:
            return self.kv.tokens.authenticate(token)
        except AuthError as err:
            self.refusals.count(source, err.reason, err.token_id)
            return None

    def _label(self, scope: Scope) -> None:
        """Name the route a refused request was for, so that metrics count it under its
        template as they count routed requests (the router never saw it)."""
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                scope["route"] = route
                return
