"""``tenantkv gateway``: serve the OpenAI-compatible tenant gateway (docs/gateway.md).

:func:`serve_gateway` takes the options and an authenticator factory (the cache opened at the
root in, a :class:`~tenantkv.gateway.KeyAuthenticator` out), so that the key source is one
argument. The command uses the cache's inference keys (:func:`_authenticator`); tests and
embedders may pass another source.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..api import TenantKV
from ..config import config_for_root, default_root
from ..errors import InvalidRequestError, TenantKVError

if TYPE_CHECKING:  # the gateway needs its extra (fastapi, httpx, xxhash) only when it runs
    from ..gateway import GatewaySettings, KeyAuthenticator

AuthenticatorFactory = Callable[[TenantKV], "KeyAuthenticator"]


@dataclass(frozen=True)
class GatewayOptions:
    """What ``tenantkv gateway`` was given on its command line."""

    root: str
    backends: tuple[str, ...]
    secret_file: Path
    signing_key_file: Path
    settings: GatewaySettings
    host: str = "127.0.0.1"
    port: int = 8480


def _authenticator(kv: TenantKV) -> KeyAuthenticator:
    """The cache's inference keys (``kv.inference_keys``): a key authenticates as the (tenant,
    scope) and tenant incarnation it was minted for, until it is revoked, expires or its
    tenant is deleted."""
    return kv.inference_keys


def _read_secret(path: Path) -> bytes:
    data = path.read_bytes().strip()
    if not data:
        raise InvalidRequestError(f"{path} is empty")
    return data


def build_gateway(
    kv: TenantKV, options: GatewayOptions, authenticator_factory: AuthenticatorFactory
) -> Any:
    """The gateway application (ASGI) for ``options`` with the factory's authenticator."""
    from ..gateway import create_gateway_app
    from ..tenant_assertion import AssertionSigner

    return create_gateway_app(
        authenticator_factory(kv),
        AssertionSigner(options.signing_key_file.read_bytes()),
        secret=_read_secret(options.secret_file),
        backends=list(options.backends),
        settings=options.settings,
    )


def serve_gateway(options: GatewayOptions, authenticator_factory: AuthenticatorFactory) -> int:
    """Open the cache, build the gateway and serve it until stopped; 2 on a setup error."""
    from .. import open as open_cache

    try:
        import uvicorn
    except ImportError as err:
        print(f"tenantkv gateway needs the gateway extra: {err}", file=sys.stderr)
        return 2
    try:
        with open_cache(config_for_root(options.root), create=False) as kv:
            app = build_gateway(kv, options, authenticator_factory)
            uvicorn.run(app, host=options.host, port=options.port, log_level="warning")
    except (TenantKVError, OSError, ValueError) as err:
        print(f"tenantkv gateway: {err}", file=sys.stderr)
        return 2
    return 0


def _cmd_gateway(args: argparse.Namespace) -> int:
    try:
        from ..gateway import GatewaySettings

        settings = GatewaySettings(audience=args.audience)
    except ImportError as err:
        print(f"tenantkv gateway needs the gateway extra: {err}", file=sys.stderr)
        return 2
    except InvalidRequestError as err:
        print(f"tenantkv gateway: {err}", file=sys.stderr)
        return 2
    options = GatewayOptions(
        root=args.root,
        backends=tuple(args.backend),
        secret_file=Path(args.secret_file),
        signing_key_file=Path(args.signing_key_file),
        settings=settings,
        host=args.host,
        port=args.port,
    )
    return serve_gateway(options, _authenticator)


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``gateway`` to the CLI's subcommands."""
    gateway = commands.add_parser(
        "gateway", help="serve the OpenAI-compatible tenant gateway in front of vllm serve"
    )
    gateway.add_argument("root", nargs="?", default=default_root())
    gateway.add_argument(
        "--backend", action="append", required=True, help="a vllm serve base URL (repeatable)"
    )
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8480)
    gateway.add_argument("--audience", required=True, help="the deployment the nodes verify")
    gateway.add_argument(
        "--secret-file", required=True, help="file holding the gateway secret (>= 32 bytes)"
    )
    gateway.add_argument(
        "--signing-key-file", required=True, help="PEM Ed25519 private key of the gateway"
    )
    gateway.set_defaults(handler=_cmd_gateway)
