"""The gateway's upstream HTTP/1.1 client (tenantkv.gateway.client) against real sockets: small
asyncio servers on 127.0.0.1 that answer as a test scripts them, so each promise of the
module (reuse, close on an early end, refusals, timeouts, the single resend, the connection
bound) is seen from the server's side."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tenantkv.gateway.client import (
    ConnectFailed,
    UpstreamClient,
    UpstreamError,
    UpstreamTimeout,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's head and body; None at the end of the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    return head + await reader.readexactly(length)


class Server:
    """A loopback server; ``handler(reader, writer, n)`` serves its n-th connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await self.handler(reader, writer, self.connections)
        finally:
            self.open -= 1
            self.closed.set()
            writer.close()

    async def answer_each(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: bytes
    ) -> None:
        while (request := await read_request(reader)) is not None:
            self.requests.append(request)
            writer.write(answer)
            await writer.drain()


def client(**kwargs: Any) -> UpstreamClient:
    options = {"max_connections": 8, "connect_timeout": 1.0, "read_timeout": 2.0, **kwargs}
    return UpstreamClient(**options)


async def body_of(c: UpstreamClient, url: str, payload: bytes = b"{}") -> tuple[int, bytes]:
    response = await c.request(b"POST", url, "/v1/completions", {"x-a": "1"}, payload)
    data = b""
    try:
        while chunk := await response.read_chunk():
            data += chunk
    finally:
        await response.aclose()
    return response.status_code, data


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))  # type: ignore[arg-type]


def test_sequential_requests_reuse_one_connection_and_send_what_was_asked() -> None:
    async def main() -> None:
        server = Server(lambda r, w, n: server.answer_each(r, w, OK))
        async with server:
            c = client()
            for _ in range(5):
                assert await body_of(c, server.url + "/prefix", b'{"a":1}') == (200, b"{}")
            assert server.connections == 1 and c.open_connections == 1
            head = server.requests[0]
            assert head.startswith(b"POST /prefix/v1/completions HTTP/1.1\r\n")
            assert b"\r\nx-a: 1\r\n" in head and b"\r\naccept-encoding: identity\r\n" in head
            assert head.endswith(b'\r\n\r\n{"a":1}')
            await c.aclose()

    run(main())


def test_an_answer_closed_before_its_end_closes_its_connection() -> None:
    async def endless(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await w.drain()
        await r.read()  # until the client closes: the backend would stop generating here

    async def main() -> None:
        async with Server(endless) as server:
            c = client()
            response = await c.request(b"POST", server.url, "/", {}, b"{}")
            assert await response.read_chunk() == b"first"
            await response.aclose()
            await asyncio.wait_for(server.closed.wait(), 2)  # the server saw the close
            assert c.open_connections == 0
            await c.aclose()

    run(main())


def test_abort_ends_a_read_waiting_on_a_silent_upstream_at_once() -> None:
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await w.drain()
        await r.read()

    async def main() -> None:
        async with Server(silent) as server:
            c = client(read_timeout=30.0)
            response = await c.request(b"POST", server.url, "/", {}, b"{}")
            reading = asyncio.ensure_future(response.read_chunk())
            await asyncio.sleep(0.05)
            response.abort()
            with pytest.raises(UpstreamError):
                await asyncio.wait_for(reading, 1)
            await response.aclose()
            await asyncio.wait_for(server.closed.wait(), 2)
            await c.aclose()

    run(main())


def test_an_encoded_answer_is_refused() -> None:
    gzip = b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 2\r\n\r\nxx"

    async def main() -> None:
        server = Server(lambda r, w, n: server.answer_each(r, w, gzip))
        async with server:
            c = client()
            with pytest.raises(UpstreamError, match="encoded"):
                await c.request(b"POST", server.url, "/", {}, b"{}")
            assert c.open_connections == 0
            await c.aclose()

    run(main())


def test_refused_connection_is_connect_failed() -> None:
    async def main() -> None:
        async with Server(lambda r, w, n: asyncio.sleep(0)) as server:
            url = server.url
        c = client()
        with pytest.raises(ConnectFailed):
            await c.request(b"POST", url, "/", {}, b"{}")  # nothing listens there any more
        await c.aclose()

    run(main())


def test_a_silent_upstream_times_out() -> None:
    async def mute(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        await r.read()

    async def main() -> None:
        async with Server(mute) as server:
            c = client(read_timeout=0.2)
            with pytest.raises(UpstreamTimeout):
                await c.request(b"POST", server.url, "/", {}, b"{}")
            await asyncio.wait_for(server.closed.wait(), 2)  # and its connection is closed
            await c.aclose()

    run(main())


def test_a_break_mid_body_is_an_error_and_an_unmarked_body_ends_with_the_close() -> None:
    async def broken(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        if n == 1:  # promises 10 bytes, sends 3
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        else:  # neither a length nor chunks: the body is what comes before the close
            w.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"a": 1}')
        await w.drain()

    async def main() -> None:
        async with Server(broken) as server:
            c = client()
            with pytest.raises(UpstreamError):
                await body_of(c, server.url)
            assert await body_of(c, server.url) == (200, b'{"a": 1}')
            assert c.open_connections == 0  # not kept: it ended with the close
            await c.aclose()

    run(main())


def test_a_kept_connection_closed_by_the_backend_is_resent_once_on_a_new_one() -> None:
    async def one_each(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        # answers the first request of a connection, then drops the next without a word
        # (a backend whose idle timeout fired as the request was sent)
        await read_request(r)
        w.write(OK)
        await w.drain()
        await read_request(r)

    async def main() -> None:
        async with Server(one_each) as server:
            c = client()
            assert await body_of(c, server.url) == (200, b"{}")
            assert await body_of(c, server.url) == (200, b"{}")
            assert server.connections == 2
            await c.aclose()

    run(main())


def test_connections_stay_within_the_bound() -> None:
    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await read_request(r) is not None:
            await asyncio.sleep(0.05)
            w.write(OK)
            await w.drain()

    async def main() -> None:
        async with Server(slow) as server:
            c = client(max_connections=2)
            answers = await asyncio.gather(*(body_of(c, server.url) for _ in range(6)))
            assert answers == [(200, b"{}")] * 6
            assert server.most_open == 2 and c.open_connections <= 2
            await c.aclose()

    run(main())


def test_a_request_waits_for_a_free_connection_no_longer_than_the_timeout() -> None:
    async def open_ended(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await w.drain()
        await r.read()

    async def main() -> None:
        async with Server(open_ended) as server:
            c = client(max_connections=1, read_timeout=0.3)
            held = await c.request(b"POST", server.url, "/", {}, b"{}")  # the only connection
            with pytest.raises(UpstreamTimeout, match="came free"):
                await c.request(b"POST", server.url, "/", {}, b"{}")
            await held.aclose()  # frees it: the next request gets one
            again = await c.request(b"POST", server.url, "/", {}, b"{}")
            assert again.status_code == 200
            await again.aclose()
            await c.aclose()

    run(main())
