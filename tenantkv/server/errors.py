"""Error answers of the admin API: one JSON shape, ``{"error": code, "detail": text}``.

TenantKV's error families map to 4xx statuses; a tenant that does not exist and a tenant the
caller may not see get the *same* 404 body (:data:`TENANT_NOT_FOUND`), so answers are no oracle
for other tenants' names. Unexpected failures answer a bare 500 without internals (logged).
"""

from __future__ import annotations

import logging
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..audit import AuditChainError, AuditError
from ..errors import (
    CacheClosedError,
    CacheUnavailableError,
    InvalidRequestError,
    JobNotFoundError,
    JobStateError,
    QuotaExceededError,
    TenantExistsError,
    TenantKVError,
    TenantNotFoundError,
)

logger = logging.getLogger("tenantkv.server")

TENANT_NOT_FOUND: Final = {"error": "not_found", "detail": "no such tenant"}
UNAUTHORIZED: Final = {"error": "unauthorized", "detail": "a valid bearer token is required"}
FORBIDDEN: Final = {"error": "forbidden", "detail": "this role may not do that"}


class ApiError(Exception):
    """An answer decided by the API itself (auth, roles, lookups)."""

    def __init__(
        self, status: int, body: dict[str, str], headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(body["detail"])
        self.status = status
        self.body = body
        self.headers = headers


def not_found() -> ApiError:
    return ApiError(404, dict(TENANT_NOT_FOUND))


def _json(status: int, code: str, detail: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail, **extra}, status_code=status)


_STATUS: Final[list[tuple[type[Exception], int, str]]] = [
    (InvalidRequestError, 422, "invalid_request"),
    (TenantExistsError, 409, "tenant_exists"),
    (QuotaExceededError, 409, "quota_exceeded"),
    (AuditChainError, 409, "audit_chain"),
    (AuditError, 422, "invalid_request"),
    (JobNotFoundError, 404, "not_found"),
    (JobStateError, 409, "job_state"),
    (CacheClosedError, 503, "unavailable"),
    (CacheUnavailableError, 503, "unavailable"),
]


def install(app: FastAPI) -> None:
    """Register the handlers on ``app``."""

    async def api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    async def cache_error(_request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, TenantNotFoundError):
            return JSONResponse(dict(TENANT_NOT_FOUND), status_code=404)
        for kind, status, code in _STATUS:
            if isinstance(exc, kind):
                return _json(status, code, str(exc)[:1000])
        logger.error("unexpected tenantkv error: %r", exc)
        return _json(500, "internal", "internal error")

    async def validation_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": e.get("type")}
            for e in exc.errors()
        ]
        return JSONResponse(
            jsonable_encoder(
                {"error": "invalid_request", "detail": "the request is invalid", "errors": errors}
            ),
            status_code=422,
        )

    async def http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(
            exc.status_code, "http_error"
        )
        return JSONResponse(
            {"error": code, "detail": str(exc.detail)},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in the admin API", exc_info=exc)
        return _json(500, "internal", "internal error")

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(TenantKVError, cache_error)
    app.add_exception_handler(AuditError, cache_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
