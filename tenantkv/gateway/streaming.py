"""Passing an upstream's server-sent events to the client as they arrive, and cancelling the
upstream request when the client goes away.

Each event is scrubbed (:mod:`scrub`) on its way: a ``data:`` line holding JSON loses any
identity-bearing field; a line from which nothing was removed passes byte for byte. The bytes go
through an :class:`events.EventCleaner`, which applies that rule line by line only to the
events that could hold such a field, and passes the others without parsing them. The client's
disconnect is watched beside the copy (not only noticed at the next write, which a silent
upstream could delay indefinitely): it closes the connection the backend is generating into,
which also ends the copy's wait for the next event.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Final

from starlette.types import Receive, Scope, Send

from .client import UpstreamError, UpstreamResponse, UpstreamTimeout
from .events import EventCleaner
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


class EventStream:
    """The ASGI response that copies ``upstream``'s events; ``done`` runs once at the end
    (releases the key's concurrency slot), whatever ends it."""

    status_code = 200
    # no Content-Length: the length of a stream is not known
    raw_headers: Final = (
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
    )

    def __init__(self, upstream: UpstreamResponse, done: Callable[[], None]) -> None:
        self._upstream = upstream
        self._done = done

    async def _events(self) -> AsyncIterator[bytes]:
        cleaner = EventCleaner(scrub_event_line)
        encoding = self._upstream.encoding
        # the cleaner cuts UTF-8; another charset is decoded and sent as UTF-8, as declared
        decoder = None if encoding == "utf-8" else codecs.getincrementaldecoder(encoding)("replace")
        try:
            while chunk := await self._upstream.read_chunk():
                if decoder is not None:
                    chunk = decoder.decode(chunk).encode()
                if out := cleaner.feed(chunk):
                    yield out
            if decoder is not None and (out := cleaner.feed(decoder.decode(b"", True).encode())):
                yield out
            if out := cleaner.end():
                yield out
        except UpstreamTimeout:
            yield _error_event("upstream_timeout", "the backend stopped answering")
        except UpstreamError:
            yield _error_event("upstream_error", "the backend's stream broke off")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The copy runs in this task; a second task only waits for the client's disconnect,
        # then closes the upstream connection (which tells the backend to stop, and ends a
        # read waiting on a silent upstream at once). No task group: one task fewer to start
        # before the first event, and nothing to cancel in the copy.
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            self._upstream.abort()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": list(self.raw_headers),
                }
            )
            async for chunk in self._events():
                if gone:
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not gone:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client is gone
            pass
        finally:
            watcher.cancel()
            await self._upstream.aclose()  # never suspends: a cancel cannot skip the release
            self._done()
