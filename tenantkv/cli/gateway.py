"""``tenantkv gateway``: serve the OpenAI-compatible tenant gateway (docs/gateway.md).

Its settings come from its flags, else the configuration file's ``[gateway]`` table
(``tenantkv.gateway.config_section``; ``--config FILE`` or ``TENANTKV_CONFIG``), else defaults:
:func:`gateway_options`.

:func:`serve_gateway` takes the options and an authenticator factory (the cache opened at the
root in, a :class:`~tenantkv.gateway.KeyAuthenticator` out), so that the key source is one
argument. The command uses the cache's inference keys (:func:`_authenticator`); tests and
embedders may pass another source.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import config_for_root, default_root
from ..errors import InvalidRequestError, TenantKVError
from ..json_logs import LOG_FORMATS, LogFormat
from ..json_logs import configure as configure_logs

#: The variable ``tenantkv serve`` reads its log format from; the gateway honours it too.
LOG_FORMAT_ENV = "TENANTKV_LOG_FORMAT"

if TYPE_CHECKING:  # the gateway needs its extra (fastapi, httpx, xxhash) only when it runs
    from ..api import TenantKV  # (and the cache its data path, torch: not for --help)
    from ..gateway import GatewaySettings, KeyAuthenticator

AuthenticatorFactory = Callable[["TenantKV"], "KeyAuthenticator"]


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
    #: ``json``: one JSON object per log line (``tenantkv.json_logs``), as ``tenantkv serve``.
    log_format: LogFormat = "text"


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
        cache_health=kv.health,
    )


def serve_gateway(options: GatewayOptions, authenticator_factory: AuthenticatorFactory) -> int:
    """Open the cache, build the gateway and serve it until stopped; 2 on a setup error."""
    from .. import open as open_cache

    try:
        import uvicorn
    except ImportError as err:
        print(f"tenantkv gateway needs the gateway extra: {err}", file=sys.stderr)
        return 2
    json_logs = options.log_format == "json"
    if json_logs:
        # As ``tenantkv serve`` does: the root logger formats every line (the cache's, the
        # gateway's, uvicorn's), secrets redacted; the request path is not touched.
        configure_logs("json", level="info")
    try:
        with open_cache(config_for_root(options.root), create=False) as kv:
            app = build_gateway(kv, options, authenticator_factory)
            # JSON: uvicorn's loggers go to the root handler configured above (no config of
            # its own); text: its defaults, as before.
            logs: dict[str, Any] = {"log_config": None} if json_logs else {}
            uvicorn.run(app, host=options.host, port=options.port, log_level="warning", **logs)
    except (TenantKVError, OSError, ValueError) as err:
        print(f"tenantkv gateway: {err}", file=sys.stderr)
        return 2
    return 0


def gateway_options(root: str, config_file: str | None = None, **flags: Any) -> GatewayOptions:
    """The options ``tenantkv gateway`` serves: its flags (those not None) > the ``[gateway]``
    table of the configuration file (``config_file``, else the one ``TENANTKV_CONFIG``
    names) > defaults. An InvalidRequestError (a ConfigFileError naming the file, line and
    field) for a bad value, or for an audience, backend or secret file given nowhere."""
    from ..gateway.config_section import load_gateway_table

    if flags.get("log_format") is None and os.environ.get(LOG_FORMAT_ENV):
        flags = {**flags, "log_format": os.environ[LOG_FORMAT_ENV]}  # flag > variable > file
    table = load_gateway_table(config_file, **flags)
    missing = table.missing()
    if missing:
        raise InvalidRequestError(
            "no "
            + ", no ".join(missing)
            + ": give "
            + ", ".join("--" + name.removesuffix("s").replace("_", "-") for name in missing)
            + " or set them in the [gateway] table of the configuration file"
        )
    assert table.audience and table.secret_file and table.signing_key_file, "missing() said none"
    return GatewayOptions(
        root=root,
        backends=tuple(table.backends),
        secret_file=Path(table.secret_file),
        signing_key_file=Path(table.signing_key_file),
        settings=table.settings(),
        host=table.host,
        port=table.port,
        log_format="json" if table.log_format == "json" else "text",
    )


def _cmd_gateway(args: argparse.Namespace) -> int:
    try:
        options = gateway_options(
            args.root,
            audience=args.audience,
            backends=args.backend,
            host=args.host,
            port=args.port,
            secret_file=args.secret_file,
            signing_key_file=args.signing_key_file,
            log_format=args.log_format,
        )
    except ImportError as err:
        print(f"tenantkv gateway needs the gateway extra: {err}", file=sys.stderr)
        return 2
    except InvalidRequestError as err:
        print(f"tenantkv gateway: {err}", file=sys.stderr)
        return 2
    return serve_gateway(options, _authenticator)


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``gateway`` to the CLI's subcommands."""
    gateway = commands.add_parser(
        "gateway", help="serve the OpenAI-compatible tenant gateway in front of vllm serve"
    )
    gateway.add_argument("root", nargs="?", default=default_root())
    gateway.add_argument(
        "--backend",
        action="append",
        default=None,
        help="a vllm serve base URL (repeatable; replaces [gateway] backends)",
    )
    gateway.add_argument("--host", default=None, help="default 127.0.0.1 ([gateway] host)")
    gateway.add_argument("--port", type=int, default=None, help="default 8480 ([gateway] port)")
    gateway.add_argument(
        "--audience", default=None, help="the deployment the nodes verify ([gateway] audience)"
    )
    gateway.add_argument(
        "--secret-file",
        default=None,
        help="file holding the gateway secret, >= 32 bytes ([gateway] secret_file)",
    )
    gateway.add_argument(
        "--signing-key-file",
        default=None,
        help="PEM Ed25519 private key of the gateway ([gateway] signing_key_file)",
    )
    gateway.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=None,
        help="text (default) or json: one object per line, no keys, tokens or prompt text "
        "([gateway] log_format, TENANTKV_LOG_FORMAT)",
    )
    gateway.set_defaults(handler=_cmd_gateway)
