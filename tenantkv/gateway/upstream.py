"""The gateway's upstream client: one ``httpx.AsyncClient`` whose connections are split over
small pools.

httpcore's connection pool re-examines every connection it holds (and, for each idle one,
counts the idle ones again) each time a request enters or leaves it: its cost per request
grows with the square of its connections. One pool sized for hundreds of concurrent requests
then spends more time choosing a connection than the request takes; profiled with 100
concurrent clients, that choice was half of the gateway's time. So the client's transport is a
set of pools of at most :data:`CONNECTIONS_PER_POOL` connections each (together at most
``max_connections``, as before), and a request goes to the pool with the fewest requests in
flight (the first of equals, so that a lightly loaded gateway reuses the same warm
connections). A request waits for a connection only when every pool is full, as it would in
one pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Final

import httpx

#: The most connections one pool holds (its bookkeeping is quadratic in them).
CONNECTIONS_PER_POOL: Final = 16


class _Counted(httpx.AsyncByteStream):
    """An answer's body that tells its pool, once, when the answer is closed."""

    def __init__(self, stream: httpx.AsyncByteStream, done: Callable[[], None]) -> None:
        self._stream = stream
        self._done: Callable[[], None] | None = done

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            done, self._done = self._done, None
            if done is not None:
                done()


class SplitPoolTransport(httpx.AsyncBaseTransport):
    """Sends each request through the least busy of several small connection pools."""

    def __init__(self, max_connections: int, *, per_pool: int = CONNECTIONS_PER_POOL) -> None:
        if max_connections < 1 or per_pool < 1:
            raise ValueError("a transport needs at least one connection per pool")
        count = -(-max_connections // per_pool)
        sizes = [max_connections // count + (i < max_connections % count) for i in range(count)]
        # one TLS context for all pools (each costs milliseconds to make); nothing is taken
        # from the environment, as the client's trust_env=False says
        tls = httpx.create_ssl_context(trust_env=False)
        self.pool_sizes = sizes
        self._pools = [
            httpx.AsyncHTTPTransport(
                verify=tls,
                trust_env=False,
                limits=httpx.Limits(max_connections=size, max_keepalive_connections=size),
            )
            for size in sizes
        ]
        self._busy = [0] * count

    @property
    def in_flight(self) -> list[int]:
        """Requests in flight per pool (answers not yet closed)."""
        return list(self._busy)

    def _least_busy(self) -> int:
        busy = self._busy
        return busy.index(min(busy))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        index = self._least_busy()
        self._busy[index] += 1

        def done() -> None:
            self._busy[index] -= 1

        try:
            response = await self._pools[index].handle_async_request(request)
        except BaseException:
            done()
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _Counted(response.stream, done)
        return response

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()
