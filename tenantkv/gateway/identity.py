"""Who a request is from, as the gateway learns it: the interface of the key service.

The gateway believes nothing a client says about its identity; it asks a key authenticator
(the inference keys of the admin API, or a test double) what the presented secret stands for.
The interface is a Protocol so that the gateway depends on no storage: whatever answers
``authenticate(secret)`` with an identity (or None for an unknown, revoked or expired key)
can sit behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GatewayIdentity:
    """The verified owner of a request: the key that authenticated it, and the (tenant, scope)
    and tenant incarnation it was minted for. The incarnation goes into the signed assertion
    and the cache salt, so a tenant deleted and created again under the same name shares
    nothing with its predecessor."""

    key_id: str
    tenant: str
    scope: str | None
    incarnation: str


class IdentityLike(Protocol):
    """What the gateway reads of an identity (the key service's own type fits it)."""

    @property
    def key_id(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def scope(self) -> str | None: ...
    @property
    def incarnation(self) -> str: ...


class KeyAuthenticator(Protocol):
    """Maps a presented inference key to its identity; None for an unknown, revoked or
    expired key (the gateway then answers 401 and sends nothing upstream)."""

    def authenticate(self, secret: str) -> IdentityLike | None: ...
