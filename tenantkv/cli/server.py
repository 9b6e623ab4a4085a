"""``tenantkv serve`` and ``tenantkv token create|list|revoke``.

``register(commands)`` adds them to the main CLI's subparsers (as ``cli_audit.register`` does).
Token commands need no web framework; ``serve`` imports the server (the ``server`` extra) only
when it runs.
"""

from __future__ import annotations

import argparse
import sys

from ..config import config_for_root, default_root
from ..errors import TenantKVError
from ..services.tokens import ROLES


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from ..server.app import run
        from ..server.settings import Settings
    except ImportError as err:
        print(
            f"tenantkv serve needs the server extra (pip install 'tenantkv[server]'): {err}",
            file=sys.stderr,
        )
        return 2
    run(Settings(root=args.root, host=args.host, port=args.port))
    return 0


def _cmd_token_create(args: argparse.Namespace) -> int:
    from .. import open as open_cache

    try:
        with open_cache(config_for_root(args.root)) as kv:
            token = kv.tokens.create(args.role, args.tenant, args.ttl)
    except TenantKVError as err:
        print(f"tenantkv token: {err}", file=sys.stderr)
        return 2
    print(token)
    return 0


def _cmd_token_list(args: argparse.Namespace) -> int:
    from .. import open as open_cache

    with open_cache(config_for_root(args.root)) as kv:
        for info in kv.tokens.listing(args.tenant):
            state = "revoked" if info.revoked_at is not None else "active"
            print(
                f"{info.id}  {info.role:<12}  {info.tenant or '-':<20}  {state}  "
                f"expires={info.expires_at if info.expires_at is not None else 'never'}"
            )
    return 0


def _cmd_token_revoke(args: argparse.Namespace) -> int:
    from .. import open as open_cache

    try:
        with open_cache(config_for_root(args.root)) as kv:
            found = kv.tokens.revoke(args.token_id)
    except TenantKVError as err:
        print(f"tenantkv token: {err}", file=sys.stderr)
        return 2
    if not found:
        print(f"tenantkv token: no token {args.token_id}", file=sys.stderr)
        return 1
    return 0


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``serve`` and ``token create|list|revoke`` to the CLI's subcommands."""
    serve = commands.add_parser("serve", help="run the admin API (loopback by default)")
    serve.add_argument("root", nargs="?", default=default_root())
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8470)
    serve.set_defaults(handler=_cmd_serve)

    token = commands.add_parser("token", help="make, list and revoke admin API tokens")
    actions = token.add_subparsers(dest="token_command", required=True)
    create = actions.add_parser("create", help="print a new token (shown once)")
    create.add_argument("root", nargs="?", default=default_root())
    create.add_argument("--role", choices=ROLES, required=True)
    create.add_argument("--tenant", default=None, help="the tenant of a tenant-admin token")
    create.add_argument("--ttl", type=float, default=None, help="lifetime in seconds")
    create.set_defaults(handler=_cmd_token_create)
    listing = actions.add_parser("list", help="list tokens (ids and metadata, no secrets)")
    listing.add_argument("root", nargs="?", default=default_root())
    listing.add_argument("--tenant", default=None)
    listing.set_defaults(handler=_cmd_token_list)
    revoke = actions.add_parser("revoke", help="revoke a token by id")
    revoke.add_argument("token_id")
    revoke.add_argument("root", nargs="?", default=default_root())
    revoke.set_defaults(handler=_cmd_token_revoke)
