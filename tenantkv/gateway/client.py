"""The gateway's upstream HTTP/1.1 client for the proxied requests: asyncio protocols and the
httptools parser, kept-alive connections per backend.

Why not httpx here: profiled with 100 concurrent clients, httpx and httpcore (request models,
header normalisation, anyio locks and streams, the pool's bookkeeping) were half of the
gateway's time per proxied request (docs/perf.md). The gateway needs a small part of HTTP: a
POST of a body it built itself, to a URL it was configured with, headers it already checked,
and an answer read as it arrives. This module does that with the parser uvicorn itself uses
(httptools, llhttp), without a task or a lock per request. httpx still serves the cold paths
(``/v1/models``, the ``/readyz`` probes; see :mod:`upstream`).

What it guarantees, because the gateway's promises rest on it:

* a connection that could not be made (refused, unreachable, past ``connect_timeout``) raises
  :class:`ConnectFailed`, so the caller tries the next backend; nothing was sent;
* an upstream silent for ``read_timeout`` (before its status line, or between two pieces of
  the body) raises :class:`UpstreamTimeout`; any other failure :class:`UpstreamError`;
* an answer that is closed before its end (the client went away) closes its connection, which
  is what tells the backend to stop generating; only an answer read to its end, on a
  connection both sides keep alive, goes back to the pool;
* a body with a ``Content-Encoding`` is refused (:class:`UpstreamError`): it would pass the
  scrub as opaque bytes. ``Accept-Encoding: identity`` is sent;
* at most ``max_connections`` connections are open, all backends together; a request waits for
  one beyond that (at most ``read_timeout``, then :class:`UpstreamTimeout`), as it would in
  httpx's pool;
* reading pauses while more than :data:`HIGH_WATER` bytes of an answer wait for the client.

A request sent on a kept-alive connection that the backend had closed meanwhile (its idle
timeout raced the reuse) is sent again once on a new connection, but only when not one byte of
an answer had come back.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final, cast
from urllib.parse import urlsplit

import httptools

#: Bytes of an answer buffered for a slow client before reading from the backend pauses.
HIGH_WATER: Final = 256 * 1024


class UpstreamError(Exception):
    """The backend failed: the connection broke, or its answer is not HTTP the gateway reads."""


class ConnectFailed(UpstreamError):
    """No connection to the backend could be made; nothing was sent."""


class UpstreamTimeout(UpstreamError):
    """The backend stayed silent past the timeout."""


class _Reset(UpstreamError):
    """A reused connection closed before any answer: the request may be sent again."""


@dataclass(frozen=True)
class Origin:
    """Where a backend's requests go: its address, TLS, ``Host`` header and path prefix."""

    host: str
    port: int
    tls: bool
    host_header: bytes
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        if not parts.hostname:
            raise ValueError(f"not a backend URL: {url!r}")
        return cls(
            host=parts.hostname,
            port=parts.port or (443 if tls else 80),
            tls=tls,
            host_header=parts.netloc.encode("ascii"),
            prefix=parts.path.rstrip("/"),
        )


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one request at a time, its answer parsed as it arrives."""

    def __init__(self, client: UpstreamClient, origin: Origin) -> None:
        self._client = client
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self._parser = httptools.HttpResponseParser(self)
        self._reset_answer()

    def _reset_answer(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self.error: UpstreamError | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # ------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without deriving from it
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._fail(UpstreamError("the backend's answer is not valid HTTP"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._client._forget(self)
        if self.complete:
            return
        if self.headers_done and not self._delimited():
            self.complete = True  # a body that ends with the connection
        elif not self.got_bytes and self.reused:
            self._fail(_Reset("the kept-alive connection was closed"))
        else:
            self._fail(UpstreamError("the backend closed the connection"))
        self._wake()

    # ------------------------------------------------------------- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if self.status < 200:  # an interim answer (100 Continue): the real one follows
            self.headers.clear()
            return
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        # asked now: the parser forgets the answer's headers once it has returned
        self.keep_alive = self._parser.should_keep_alive()
        self.complete = True
        self._wake()

    # ------------------------------------------------------------- used by the answer

    def _delimited(self) -> bool:
        """Whether the body's end is marked (a length, chunks) rather than the close."""
        return any(name in (b"content-length", b"transfer-encoding") for name, _ in self.headers)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until something new arrives (or the connection ends), at most ``timeout`` s."""
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        handle = loop.call_later(timeout, self._timeout, self.waiter)
        try:
            await self.waiter
        finally:
            handle.cancel()
            self.waiter = None

    @staticmethod
    def _timeout(waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(UpstreamTimeout("the backend did not answer in time"))

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True
        self._client._forget(self)
        if not self.complete:  # a reader waiting for more learns now, not at connection_lost
            self._fail(UpstreamError("the connection was closed"))
            self._wake()

    def send(self, head: bytes, body: bytes | None) -> None:
        assert self.transport is not None
        self._reset_answer()
        self.transport.write(head + body if body else head)


class UpstreamResponse:
    """An answer: status and headers now, the body by :meth:`read_chunk`; :meth:`aclose` it."""

    def __init__(self, connection: _Connection, read_timeout: float) -> None:
        self._conn: _Connection | None = connection
        self._read_timeout = read_timeout
        self.status_code = connection.status
        self.headers = connection.headers

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lowercase)."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def encoding(self) -> str:
        """The codec of the charset its ``Content-Type`` names; UTF-8 when it names none or
        one Python does not know (as httpx decides)."""
        kind = self.header(b"content-type") or b""
        for param in kind.split(b";")[1:]:
            name, _, value = param.partition(b"=")
            if name.strip().lower() == b"charset":
                try:
                    return codecs.lookup(value.strip(b" \"'").decode("ascii")).name
                except (LookupError, UnicodeDecodeError):
                    break
        return "utf-8"

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (the same name as httpx's, for the same use)."""
        while chunk := await self.read_chunk():
            yield chunk

    async def read_chunk(self) -> bytes:
        """The next piece of the body; ``b""`` at its end."""
        conn = self._conn
        if conn is None:
            return b""
        while True:
            if conn.chunks:
                return conn.take()
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._read_timeout)

    def abort(self) -> None:
        """Close the connection now (the client went away): the backend sees it closed, and a
        :meth:`read_chunk` waiting raises. :meth:`aclose` is still to be called."""
        if self._conn is not None:
            self._conn.close()

    async def aclose(self) -> None:
        """Give the connection back if the answer was read to its end, else close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.reusable() and not conn.chunks:
            conn._client._release(conn)
        else:
            conn.close()
            conn._client._release(None)


class UpstreamClient:
    """Kept-alive HTTP/1.1 connections to the backends, at most ``max_connections`` open."""

    def __init__(
        self, *, max_connections: int, connect_timeout: float, read_timeout: float
    ) -> None:
        if max_connections < 1:
            raise ValueError("a client needs at least one connection")
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._origins: dict[str, Origin] = {}
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._slots = asyncio.Semaphore(max_connections)  # requests in flight
        self._max = max_connections
        self._tls: ssl.SSLContext | None = None

    def origin(self, url: str) -> Origin:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = Origin.parse(url)
        return origin

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def request(
        self,
        method: bytes,
        url: str,
        path: str,
        headers: dict[str, str],
        body: bytes | None,
    ) -> UpstreamResponse:
        """Send a request to backend ``url`` + ``path``; the answer once its headers are in."""
        origin = self.origin(url)
        lines = [
            method,
            b" ",
            (origin.prefix + path).encode("ascii"),
            b" HTTP/1.1\r\nhost: ",
            origin.host_header,
            b"\r\naccept-encoding: identity\r\n",
        ]
        for name, value in headers.items():
            lines += (name.encode("ascii"), b": ", value.encode("ascii"), b"\r\n")
        if body is not None:
            lines += (b"content-length: ", str(len(body)).encode(), b"\r\n")
        lines.append(b"\r\n")
        head = b"".join(lines)
        if self._slots.locked():  # every connection busy: wait, but not past the timeout
            try:
                await asyncio.wait_for(self._slots.acquire(), self._read_timeout)
            except TimeoutError:
                raise UpstreamTimeout("no upstream connection came free in time") from None
        else:
            await self._slots.acquire()
        try:
            conn = await self._connection(origin)
            try:
                return await self._exchange(conn, head, body)
            except _Reset:
                conn = await self._connect(origin)  # once, on a new connection
                return await self._exchange(conn, head, body)
        except BaseException:
            self._slots.release()
            raise

    async def _exchange(
        self, conn: _Connection, head: bytes, body: bytes | None
    ) -> UpstreamResponse:
        conn.send(head, body)
        try:
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                if conn.closed:
                    raise UpstreamError("the backend closed the connection")
                await conn.wait(self._read_timeout)
        except BaseException:
            conn.close()
            raise
        if any(
            name == b"content-encoding" and value.strip().lower() != b"identity"
            for name, value in conn.headers
        ):
            conn.close()
            raise UpstreamError("the backend's answer is encoded")
        return UpstreamResponse(conn, self._read_timeout)

    async def _connection(self, origin: Origin) -> _Connection:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()  # the most recently used: the likeliest to be alive
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                return conn
            conn.close()
        return await self._connect(origin)

    async def _connect(self, origin: Origin) -> _Connection:
        if len(self._open) >= self._max:
            self._evict_idle()
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if origin.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        conn = _Connection(self, origin)
        try:
            await asyncio.wait_for(
                loop.create_connection(
                    lambda: conn,
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls else None,
                ),
                self._connect_timeout,
            )
        except (OSError, TimeoutError, ssl.SSLError) as err:
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}") from err
        self._open.add(conn)
        return conn

    def _evict_idle(self) -> None:
        for idle in self._idle.values():
            if idle:
                idle.pop(0).close()  # the least recently used
                return

    def _release(self, conn: _Connection | None) -> None:
        """A request's end: its slot back; its connection to the idle list if given."""
        if conn is not None:
            self._idle.setdefault(conn.origin, []).append(conn)
        self._slots.release()

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    async def aclose(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
