"""``tenantkv key create|list|revoke``: inference keys of a tenant, on the host.

Like the token commands, they open an existing cache only (``create=False``: a mistyped root is
refused, not made into a new empty cache), need no web framework, and are audited as the user
running them (``cli:<user>``). ``key create`` prints the key on stdout, once (only its hash is
kept), and its id and expiry on stderr, so ``KEY=$(tenantkv key create ...)`` keeps just the
key.
"""

from __future__ import annotations

import argparse
import sys

from ..audit import ROLE_OPERATOR, Attribution
from ..config import config_for_root, default_root
from ..errors import TenantKVError
from .audit import _actor


def _cmd_create(args: argparse.Namespace) -> int:
    from .. import open as open_cache

    try:
        with open_cache(config_for_root(args.root), create=False) as kv:
            info, secret = kv.inference_keys.create(
                args.tenant,
                args.name,
                scope=args.scope,
                expires_in=args.expires_in,
                actor=Attribution(_actor(), ROLE_OPERATOR),
            )
    except TenantKVError as err:
        print(f"tenantkv key: {err}", file=sys.stderr)
        return 2
    expires = "never" if info.expires_at is None else f"{info.expires_at:.0f}"
    print(f"inference key {info.id} (shown once; expires={expires}):", file=sys.stderr)
    print(secret)
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from .. import open as open_cache

    try:
        with open_cache(config_for_root(args.root), create=False) as kv:
            keys = kv.inference_keys.list(args.tenant)
            now = kv.now()
    except TenantKVError as err:
        print(f"tenantkv key: {err}", file=sys.stderr)
        return 2
    for info in keys:
        if info.revoked_at is not None:
            state = "revoked"
        elif info.expires_at is not None and now >= info.expires_at:
            state = "expired"
        else:
            state = "active"
        print(
            f"{info.id}  {info.name:<20}  scope={info.scope or '-':<16}  {state:<7}  "
            f"uses={info.uses}  "
            f"expires={'never' if info.expires_at is None else f'{info.expires_at:.0f}'}"
        )
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    from .. import open as open_cache

    try:
        with open_cache(config_for_root(args.root), create=False) as kv:
            found = kv.inference_keys.revoke(
                args.tenant, args.key_id, actor=Attribution(_actor(), ROLE_OPERATOR)
            )
    except TenantKVError as err:
        print(f"tenantkv key: {err}", file=sys.stderr)
        return 2
    if not found:
        print(f"tenantkv key: no key {args.key_id} of tenant {args.tenant}", file=sys.stderr)
        return 1
    return 0


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``key create|list|revoke`` to the CLI's subcommands."""
    key = commands.add_parser("key", help="make, list and revoke inference keys of a tenant")
    actions = key.add_subparsers(dest="key_command", required=True)
    create = actions.add_parser("create", help="print a new inference key (shown once)")
    create.add_argument("root", nargs="?", default=default_root())
    create.add_argument("--tenant", required=True)
    create.add_argument("--name", required=True, help="what the key is for (shown in listings)")
    create.add_argument("--scope", default=None, help="the scope requests with it are served as")
    create.add_argument("--expires-in", type=float, default=None, help="lifetime in seconds")
    create.set_defaults(handler=_cmd_create)
    listing = actions.add_parser("list", help="list a tenant's keys (no secrets), with use counts")
    listing.add_argument("root", nargs="?", default=default_root())
    listing.add_argument("--tenant", required=True)
    listing.set_defaults(handler=_cmd_list)
    revoke = actions.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id")
    revoke.add_argument("root", nargs="?", default=default_root())
    revoke.add_argument("--tenant", required=True)
    revoke.set_defaults(handler=_cmd_revoke)
