"""The serving policy: what a failing index or block store does to a request.

The cache must never fail inference: by default an operation whose index or block store fails
degrades to a miss, logged and counted (``degraded_<operation>``), and is not billed to the
tenant as one. A caller that opened the cache with ``strict=True`` gets
:class:`~tenantkv.errors.CacheUnavailableError` instead. One policy, applied the same way to
lookup, cached_length, store, load and prefetch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeVar

from ..errors import CacheMissError, CacheUnavailableError, TenantKVError
from .health import HealthCounters

logger = logging.getLogger("tenantkv")

T = TypeVar("T")


@dataclass(frozen=True)
class ServingPolicy:
    strict: bool
    health: HealthCounters

    def degrade(self, operation: str, err: Exception, fallback: T) -> T:
        """``fallback`` (a miss) for ``operation``, or CacheUnavailableError when strict."""
        raise_or_count = self.unavailable(operation, err)
        if raise_or_count is not None:
            raise raise_or_count from err
        return fallback

    def unavailable(self, operation: str, err: Exception) -> TenantKVError | None:
        """The error strict mode raises for ``operation``; None (counted and logged) otherwise."""
        if self.strict:
            return CacheUnavailableError(f"{operation} failed: {err}")
        logger.warning("%s degraded to a miss: %s", operation, err)
        self.health.count(f"degraded_{operation}")
        return None

    def load_unavailable(self, err: Exception, backend: str = "index") -> TenantKVError:
        """What a load raises when the index (or, ``backend="block store"``, the block store)
        fails before its first layer: a miss, or (strict) CacheUnavailableError."""
        return self.unavailable("load", err) or CacheMissError(f"{backend} unavailable: {err}")
