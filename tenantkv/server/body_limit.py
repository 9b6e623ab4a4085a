"""A cap on request bodies, enforced as the bytes arrive (a pure ASGI middleware).

The largest legitimate body of the admin API is a few kilobytes (a tenant with its retention
map), yet nothing bounded what a caller could send: the framework reads and parses a whole body
before the route runs. So a body announced (``Content-Length``) as larger than the limit is
refused with 413 before any of it is read, and a body without a length (chunked) is counted
chunk by chunk and cut off at the limit. Starlette's ``BaseHTTPMiddleware`` would buffer the
body itself, hence a plain ASGI class.
"""

from __future__ import annotations

from typing import Final

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a body passes the limit. An ``HTTPException``, so that the
    framework's body reading re-raises it as it is and the API's handler answers 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes")


def too_large(limit: int) -> JSONResponse:
    return JSONResponse(
        {"error": "too_large", "detail": f"the request body is larger than {limit} bytes"},
        status_code=413,
    )


def declared_length(scope: Scope) -> int | None:
    """The ``Content-Length`` of a request, if it has a valid one."""
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` (413), before reading them where the length is
    announced, and as soon as the count passes the limit otherwise."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = declared_length(scope)
        if declared is not None and declared > limit:
            await too_large(limit)(scope, receive, send)
            return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def noting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, noting_send)
        except BodyTooLarge:
            if started:
                raise
            await too_large(limit)(scope, receive, send)
