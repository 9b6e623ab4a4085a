"""Prefix-affinity routing: rendezvous (highest random weight) hashing over the backends.

Each backend scores ``xxh3_64(digest || url)`` and the request goes to the highest score, then
the next on failure. The digest is already keyed (see :mod:`keyed`), so a fast non-cryptographic
hash suffices. Rendezvous hashing moves only the prefixes of a removed backend, and ranks the
same backend first for the same digest on every gateway replica.

A backend that refused a connection is ranked after the others for ``cooldown`` seconds, so a
dead backend does not cost every request a connection attempt; it is still tried last.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import xxhash


class Router:
    """Ranks backends for a digest, remembering for a while which ones failed."""

    def __init__(
        self,
        backends: Sequence[str],
        *,
        cooldown: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backends = tuple(backends)
        self._encoded = [(url, url.encode()) for url in self.backends]
        self._cooldown = cooldown
        self._clock = clock
        self._failed_until: dict[str, float] = {}

    def rank(self, digest: bytes) -> list[str]:
        """Backends in the order to try them for this digest."""
        ranked = sorted(
            self._encoded, key=lambda item: xxhash.xxh3_64_intdigest(digest + item[1]), reverse=True
        )
        order = [url for url, _ in ranked]
        if self._failed_until:
            now = self._clock()
            down = {url for url, until in self._failed_until.items() if until > now}
            if down:
                order = [u for u in order if u not in down] + [u for u in order if u in down]
        return order

    def failed(self, url: str) -> None:
        """``url`` refused or could not be reached: rank it last for a while."""
        self._failed_until[url] = self._clock() + self._cooldown

    def answered(self, url: str) -> None:
        """``url`` answered: it is ranked by its score again."""
        self._failed_until.pop(url, None)
