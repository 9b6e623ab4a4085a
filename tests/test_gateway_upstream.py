"""The gateway's upstream transport (tenantkv/gateway/upstream.py): connections split over small
pools, together no more than the gateway's limit, each request sent through the least busy
pool, and the count of requests in flight given back whichever way an answer ends."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tenantkv.gateway.upstream import CONNECTIONS_PER_POOL, SplitPoolTransport

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A keep-alive HTTP/1.1 server that answers ``{}`` to each bodiless request."""
    try:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(ANSWER)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _server() -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("limit", "sizes"),
    [(1, [1]), (16, [16]), (17, [9, 8]), (20, [10, 10]), (512, [16] * 32)],
)
def test_pools_share_the_connection_limit(limit: int, sizes: list[int]) -> None:
    transport = SplitPoolTransport(limit)
    assert transport.pool_sizes == sizes
    assert sum(transport.pool_sizes) == limit
    assert max(transport.pool_sizes) <= CONNECTIONS_PER_POOL


def test_requests_go_to_the_least_busy_pool_and_are_given_back() -> None:
    async def scenario() -> None:
        server, url = await _server()
        transport = SplitPoolTransport(3, per_pool=1)
        try:
            async with httpx.AsyncClient(transport=transport) as client:
                # one answer at a time: always the first pool (its warm connection reused)
                for _ in range(3):
                    assert (await client.get(url)).json() == {}
                    assert transport.in_flight == [0, 0, 0]
                # three open answers: one per pool
                open_answers = [
                    await client.send(client.build_request("GET", url), stream=True)
                    for _ in range(3)
                ]
                assert transport.in_flight == [1, 1, 1]
                await open_answers[1].aclose()
                assert transport.in_flight == [1, 0, 1]
                await open_answers[1].aclose()  # closing twice gives back once
                assert transport.in_flight == [1, 0, 1]
                for answer in open_answers:
                    await answer.aclose()
                assert transport.in_flight == [0, 0, 0]
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


def test_a_failed_request_is_given_back() -> None:
    async def scenario() -> None:
        server, url = await _server()
        server.close()
        await server.wait_closed()  # nothing listens there now
        transport = SplitPoolTransport(2, per_pool=1)
        async with httpx.AsyncClient(transport=transport) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(url)
        assert transport.in_flight == [0, 0]

    asyncio.run(scenario())
