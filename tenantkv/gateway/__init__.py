"""``tenantkv gateway``: an OpenAI-compatible reverse proxy in front of ``vllm serve`` that
authenticates inference keys and makes the identity the engines see the gateway's, never the
client's (see docs/gateway.md)."""

from .app import create_gateway_app
from .identity import GatewayIdentity, IdentityLike, KeyAuthenticator
from .settings import GatewaySettings

__all__ = [
    "GatewayIdentity",
    "GatewaySettings",
    "IdentityLike",
    "KeyAuthenticator",
    "create_gateway_app",
]
