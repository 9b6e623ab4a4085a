"""The admin API's roles and token lifetimes, as values: what the CLI's parser offers and checks
without importing the token service (and with it the cache's components and torch)."""

from __future__ import annotations

from typing import Final, Literal

Role = Literal["operator", "tenant-admin", "auditor"]
ROLES: Final[tuple[Role, ...]] = ("operator", "tenant-admin", "auditor")
MAX_TTL_SECONDS: Final = 366 * 86400.0
#: Lifetime of the bootstrap operator token and of a recovered one (``tenantkv init
#: --token-ttl``, ``tenantkv token recover --ttl``): long enough to mint lasting credentials.
BOOTSTRAP_TTL_SECONDS: Final = 86400.0
