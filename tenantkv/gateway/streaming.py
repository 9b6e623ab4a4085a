"""Passing an upstream's server-sent events to the client as they arrive, and cancelling the
upstream request when the client goes away.

Each event is scrubbed (:mod:`scrub`) on its way: a ``data:`` line holding JSON loses any
identity-bearing field; a line from which nothing was removed passes byte for byte. The client's
disconnect is watched beside the copy (not only noticed at the next write, which a silent
upstream could delay indefinitely): it cancels the copy and closes the upstream response,
which closes the connection the backend is generating into.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .scrub import scrub

logger = logging.getLogger("tenantkv")


def scrub_event_line(line: str) -> str:
    """One SSE line with identity-bearing fields removed from its JSON data, if any."""
    if not line.startswith("data:"):
        return line
    payload = line[5:].lstrip(" ")
    if not payload or payload == "[DONE]":
        return line
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):
        return line
    if not scrub(data):
        return line
    return "data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def _error_event(kind: str, message: str) -> bytes:
    error = {"error": {"message": message, "type": kind}}
    return f"data: {json.dumps(error)}\n\n".encode()


class EventStream(Response):
    """The ASGI response that copies ``upstream``'s events; ``done`` runs once at the end
    (releases the key's concurrency slot), whatever ends it."""

    media_type = "text/event-stream"

    def __init__(self, upstream: httpx.Response, done: Callable[[], None]) -> None:
        super().__init__(status_code=200, media_type=self.media_type)
        # no Content-Length: the length of a stream is not known
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]
        self._upstream = upstream
        self._done = done

    async def _events(self) -> AsyncIterator[bytes]:
        lines: list[str] = []
        try:
            async for line in self._upstream.aiter_lines():
                lines.append(scrub_event_line(line))
                if not line:  # a blank line ends an event: send it now
                    yield "\n".join(lines).encode() + b"\n"
                    lines.clear()
            if lines:
                yield "\n".join(lines).encode() + b"\n\n"
        except httpx.TimeoutException:
            yield _error_event("upstream_timeout", "the backend stopped answering")
        except httpx.HTTPError:
            yield _error_event("upstream_error", "the backend's stream broke off")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def copy() -> None:
                    try:
                        await send(
                            {
                                "type": "http.response.start",
                                "status": self.status_code,
                                "headers": self.raw_headers,
                            }
                        )
                        async for chunk in self._events():
                            await send(
                                {"type": "http.response.body", "body": chunk, "more_body": True}
                            )
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    except OSError:  # the client is gone
                        pass
                    finally:
                        group.cancel_scope.cancel()

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(copy)
                group.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                await self._upstream.aclose()
            self._done()
