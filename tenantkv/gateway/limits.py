"""Per-key concurrency: at most N requests of one inference key in flight (429 beyond).

One counter per key in the event loop's thread (no lock: nothing awaits between the check and
the increment). A lease is released exactly once, whichever of the paths that end a request
(an answer, a finished or cancelled stream, an error) gets there first.
"""

from __future__ import annotations


class Lease:
    """One request's slot; :meth:`release` is idempotent."""

    __slots__ = ("_key", "_limiter")

    def __init__(self, limiter: KeyLimiter, key: str) -> None:
        self._limiter: KeyLimiter | None = limiter
        self._key = key

    def release(self) -> None:
        limiter, self._limiter = self._limiter, None
        if limiter is not None:
            limiter._release(self._key)


class KeyLimiter:
    """Counts requests in flight per key; :meth:`acquire` gives None at the limit."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._in_flight: dict[str, int] = {}

    def acquire(self, key: str) -> Lease | None:
        count = self._in_flight.get(key, 0)
        if count >= self._limit:
            return None
        self._in_flight[key] = count + 1
        return Lease(self, key)

    def in_flight(self, key: str) -> int:
        return self._in_flight.get(key, 0)

    def _release(self, key: str) -> None:
        count = self._in_flight.get(key, 0) - 1
        if count > 0:
            self._in_flight[key] = count
        else:
            self._in_flight.pop(key, None)
