"""Bounds on the time a call waits for a PostgreSQL index, by kind of call.

A connect timeout alone covers only new connections: an index that accepted a connection and
then went silent (a partition that drops packets, a failed-over address gone dark, a proxy that
stalls) held a lookup for minutes, and so did the pool's pre-ping. Every wait on the server is
bounded here, with what the driver and the server provide rather than a thread racing a clock:

* psycopg's own wait timeout on every round trip: the connection class below hands the time left
  to ``Connection.wait``; a round trip that runs out of it closes the connection (``finish``),
  which SQLAlchemy then sees as broken and discards instead of returning it to the pool;
* the time left bounds a new connection too (``connect_timeout``; libpq's floor is 2 s), and a
  call whose time is already spent is refused at once instead of connecting;
* on the server, ``statement_timeout`` and ``lock_timeout`` end a statement that runs or waits
  on a lock too long, so it fails cleanly and its connection stays usable;
* in the kernel, ``tcp_user_timeout`` and keepalives drop a connection whose packets are no
  longer acknowledged (a real partition), also for connections idle in the pool.

A call's time is its index transaction's: :func:`deadline` sets it for the thread for as long
as the transaction runs (the innermost, shortest one wins), and each round trip waits at most
what is left of it. Outside such a transaction, each round trip gets the bound of its engine.
The pool's checkout timeout bounds the wait for a free connection.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

from sqlalchemy import Engine, event

#: libpq never gives a new connection less than this (``connect_timeout`` below 2 is 2).
LIBPQ_MIN_CONNECT_S = 2
#: The server's timeouts end a statement this much before the client's bound, so that it fails
#: with the server's error (the connection stays usable) rather than by the client's (the
#: connection is closed and a new one must be made).
_SERVER_SHARE = 0.8

_local = threading.local()


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Bound every index round trip this thread makes until the block ends to ``seconds`` in
    all (from now); within an outer bound, the earlier end wins. ``None`` changes nothing."""
    if seconds is None:
        yield
        return
    outer: float | None = getattr(_local, "deadline", None)
    end = time.monotonic() + seconds
    _local.deadline = end if outer is None else min(outer, end)
    try:
        yield
    finally:
        _local.deadline = outer


def time_left(default: float) -> float:
    """Seconds this thread may still wait on the index: what is left of its :func:`deadline`,
    else ``default`` (one round trip's bound)."""
    end: float | None = getattr(_local, "deadline", None)
    if end is None:
        return default
    return min(default, end - time.monotonic())


def bounded_connect_args(seconds: float, query: Any) -> dict[str, Any]:
    """libpq settings that drop a connection whose packets go unacknowledged for ``seconds``
    (a partition), in use or idle in the pool. Settings the URL names win."""
    args: dict[str, Any] = {
        "tcp_user_timeout": max(1, math.ceil(seconds * 1000)),
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(seconds)),
        "keepalives_interval": max(1, math.ceil(seconds / 3)),
        "keepalives_count": 3,
    }
    return {name: value for name, value in args.items() if name not in query}


def server_options(seconds: float) -> str:
    """libpq ``options`` that set the server's statement and lock timeouts for the session."""
    ms = max(1, int(seconds * _SERVER_SHARE * 1000))
    return f"-c statement_timeout={ms} -c lock_timeout={ms}"


def install(engine: Engine, seconds: float) -> None:
    """Make ``engine`` open connections bounded to ``seconds`` per round trip (and a new
    connection to the earlier of its connect timeout and the time left), with the server's
    timeouts set below it."""
    from psycopg import OperationalError

    options = server_options(seconds)

    @event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        left = time_left(seconds)
        if left <= 0:
            raise OperationalError(
                f"the index did not answer within {seconds:g} s (no time left to connect)"
            )
        params = dict(cparams)
        given = params.get("connect_timeout")  # the URL's, or the cache's default
        within = math.ceil(left) if given is None else min(int(float(given)), math.ceil(left))
        params["connect_timeout"] = max(LIBPQ_MIN_CONNECT_S, within)
        params["options"] = f"{params.get('options', '')} {options}".strip()
        connection = _bounded_connection_class().connect(*cargs, **params)
        connection.round_trip_s = seconds
        return connection


@functools.cache
def _bounded_connection_class() -> type[Any]:
    """The connection class, built on first use: psycopg is an optional dependency."""
    import psycopg
    from psycopg import errors

    # psycopg offers no public per-round-trip timeout; ``Connection.wait(timeout=)`` and the
    # ``_WaitTimeout`` it raises are what its own bounded waits use (3.3). Resolved here, at
    # the first connection, so that a psycopg without them fails every connection loudly
    # instead of leaving the index's waits unbounded (pyproject asks for 3.3, as tested).
    wait_timeout: type[BaseException] = getattr(errors, "_WaitTimeout", None) or _missing()
    if "timeout" not in inspect.signature(psycopg.Connection.wait).parameters:
        _missing()

    class _BoundedConnection(psycopg.Connection[Any]):
        """A psycopg connection whose every wait on the server ends within its bound."""

        round_trip_s: float = 0.0

        def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
            if timeout is not None or not self.round_trip_s:  # psycopg's own bounded waits
                return super().wait(gen, interval, timeout)
            left = time_left(self.round_trip_s)
            try:
                if left <= 0:
                    raise wait_timeout("no time left")
                return super().wait(gen, interval, left)
            except wait_timeout:
                # Mid-protocol, the connection's state is unknown: close it, so that it is
                # discarded (SQLAlchemy sees it broken) instead of going back to the pool.
                self.pgconn.finish()
                raise psycopg.OperationalError(
                    f"the index did not answer within {self.round_trip_s:g} s"
                ) from None

    return _BoundedConnection


def _missing() -> NoReturn:
    import psycopg

    raise RuntimeError(
        f"psycopg {psycopg.__version__} lacks the bounded wait tenantkv relies on "
        "(Connection.wait(timeout=), errors._WaitTimeout); install psycopg 3.3"
    )
