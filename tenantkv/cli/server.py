"""``tenantkv serve`` and ``tenantkv token create|list|revoke|recover``.

``register(commands)`` adds them to the main CLI's subparsers (as ``cli_audit.register`` does).
Token commands need no web framework; ``serve`` imports the server (the ``server`` extra) only
when it runs. Every one of them opens an existing cache only (``create=False``): a mistyped
root is refused, not made into a new empty cache.

``token recover`` is the way back in when every operator token is lost, revoked or expired: run
on the host, by whoever can open the cache (its index and master key), it mints an operator
token that expires, audited, and hands it only to a terminal or a new 0600 file, never to a
pipe or a log.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..audit import ROLE_OPERATOR, Attribution
from ..config import config_for_root, default_root
from ..errors import InvalidRequestError, TenantKVError
from ..token_limits import BOOTSTRAP_TTL_SECONDS, ROLES
from .audit import _actor


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from ..server.app import run
        from ..server.settings import load_settings
    except ImportError as err:
        print(
            f"tenantkv serve needs the server extra (pip install 'tenantkv[server]'): {err}",
            file=sys.stderr,
        )
        return 2
    from pydantic import ValidationError

    flags = {"host": args.host, "port": args.port, "log_format": args.log_format}
    try:
        settings = load_settings(
            root=args.root, **{k: v for k, v in flags.items() if v is not None}
        )
    except ValidationError as err:
        print(f"tenantkv serve: {_settings_problem(err)}", file=sys.stderr)
        return 2
    run(settings)
    return 0


def _settings_problem(err: Any) -> str:
    """One sentence per bad setting of a pydantic ValidationError: the setting, where it can
    come from (flag, ``[server]`` table, ``TENANTKV_*`` variable), and what is wrong."""
    problems = []
    for item in err.errors():
        field = ".".join(str(part) for part in item.get("loc", ())) or "a setting"
        given = item.get("input")
        flag = "--" + field.replace("_", "-")
        problems.append(
            f"{field} = {given!r} is refused ({item.get('msg', 'invalid')}; set by {flag}, "
            f"[server] {field} or TENANTKV_{field.upper()})"
        )
    return "; ".join(problems)


def _cmd_token_create(args: argparse.Namespace) -> int:
    from .. import open as open_cache

    try:
        with open_cache(config_for_root(args.root), create=False) as kv:
            token = kv.tokens.create(args.role, args.tenant, args.ttl, name=args.name)
    except TenantKVError as err:
        print(f"tenantkv token: {err}", file=sys.stderr)
        return 2
    print(token)
    return 0


def _cmd_token_list(args: argparse.Namespace) -> int:
    from .output import opened, print_json, table, when

    with opened(args.root) as kv:
        tokens = kv.tokens.listing(args.tenant)
        now = kv.now()
    if args.json:
        print_json(tokens)
        return 0
    table(
        f"{len(tokens)} token(s)",
        ["id", "name", "role", "tenant", "state", "created", "expires", "minted by"],
        [
            (
                info.id,
                info.name or "-",
                info.role,
                info.tenant or "-",
                _token_state(info.revoked_at, info.expires_at, now),
                when(info.created_at),
                when(info.expires_at) if info.expires_at is not None else "never",
                info.minted_by or info.created_by,
            )
            for info in tokens
        ],
    )
    return 0


def _token_state(revoked_at: float | None, expires_at: float | None, now: float) -> str:
    if revoked_at is not None:
        return "revoked"
    if expires_at is not None and now >= expires_at:
        return "expired"
    return "active"


def _cmd_whoami(args: argparse.Namespace) -> int:
    """Who a token is (id, name, role, tenant, expiry), checked against the index as the admin
    API would: read from ``--token-file`` or stdin, never from the command line (where other
    users and shell history would see it)."""
    from ..services.tokens import AuthError
    from .output import fields, opened, print_json, when

    if args.token_file == "-":
        if sys.stdin.isatty():
            raise InvalidRequestError("give the token on stdin (a pipe) or with --token-file FILE")
        token = sys.stdin.readline().strip()
    else:
        try:
            token = Path(args.token_file).read_text(encoding="utf-8").strip()
        except OSError as err:
            raise InvalidRequestError(f"cannot read the token file: {err.strerror}") from None
    with opened(args.root) as kv:
        try:
            principal = kv.tokens.authenticate(token)
        except AuthError as err:
            raise InvalidRequestError(f"the token is not valid ({err.reason})") from None
        info = kv.tokens.describe(principal.token_id)
    who = {
        "token_id": principal.token_id,
        "name": None if info is None else info.name,
        "role": principal.role,
        "tenant": principal.tenant,
        "expires_at": principal.expires_at,
    }
    if args.json:
        print_json(who)
    else:
        fields([*list(who.items())[:-1], ("expires", when(principal.expires_at))])
    return 0


def _cmd_token_revoke(args: argparse.Namespace) -> int:
    from .. import open as open_cache

    try:
        with open_cache(config_for_root(args.root), create=False) as kv:
            found = kv.tokens.revoke(args.token_id)
    except TenantKVError as err:
        print(f"tenantkv token: {err}", file=sys.stderr)
        return 2
    if not found:
        print(f"tenantkv token: no token {args.token_id}", file=sys.stderr)
        return 1
    return 0


def _private_new_file(path: str) -> int:
    """A new file at ``path``, 0600, opened for writing; an existing path (a file, or a link
    that could point anywhere) is refused rather than overwritten."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)  # the mode given to open is filtered by the umask
    return fd


def _cmd_token_recover(args: argparse.Namespace) -> int:
    from .. import open as open_cache

    if args.out is None and not sys.stdout.isatty():
        print(
            "tenantkv token recover: stdout is not a terminal and a token written there could "
            "reach a log or a pipe; use --out FILE for a new 0600 file",
            file=sys.stderr,
        )
        return 2
    fd: int | None = None
    try:
        if args.out is not None:
            fd = _private_new_file(args.out)
        with open_cache(config_for_root(args.root), create=False) as kv:
            issued = kv.tokens.recover_operator(
                Attribution(_actor(), ROLE_OPERATOR), ttl_seconds=args.ttl
            )
        if fd is None:
            print(issued.token)
        else:
            os.write(fd, (issued.token + "\n").encode("ascii"))
            os.fsync(fd)
    except (TenantKVError, OSError) as err:
        if fd is not None:
            os.close(fd)
            fd = None
            with contextlib.suppress(OSError):  # no token reached it: leave no empty file
                if Path(args.out).stat().st_size == 0:
                    os.unlink(args.out)
        print(f"tenantkv token recover: {err}", file=sys.stderr)
        return 2
    finally:
        if fd is not None:
            os.close(fd)
    where = "above" if args.out is None else f"in {args.out}"
    expires = issued.info.expires_at
    until = "never" if expires is None else datetime.fromtimestamp(expires, UTC).isoformat()
    print(
        f"operator token {issued.info.id} (expires {until}) is {where}; "
        "the recovery is in the audit log",
        file=sys.stderr,
    )
    return 0


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``serve`` and ``token create|list|revoke|recover`` to the CLI's subcommands."""
    serve = commands.add_parser("serve", help="run the admin API (loopback by default)")
    serve.add_argument("root", nargs="?", default=default_root())
    serve.add_argument("--host", default=None, help="default 127.0.0.1 ([server] host)")
    serve.add_argument("--port", type=int, default=None, help="default 8470 ([server] port)")
    serve.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=None,
        help="text (default) or json: one object per line with request ids, no secrets "
        "([server] log_format; tenant names only with [server] log_tenants)",
    )
    serve.set_defaults(handler=_cmd_serve)

    token = commands.add_parser("token", help="make, list and revoke admin API tokens")
    actions = token.add_subparsers(dest="token_command", required=True)
    create = actions.add_parser("create", help="print a new token (shown once)")
    create.add_argument("root", nargs="?", default=default_root())
    create.add_argument("--role", choices=ROLES, required=True)
    create.add_argument("--tenant", default=None, help="the tenant of a tenant-admin token")
    create.add_argument("--ttl", type=float, default=None, help="lifetime in seconds")
    create.add_argument("--name", default=None, help="what the token is for (listings, whoami)")
    create.set_defaults(handler=_cmd_token_create)
    listing = actions.add_parser("list", help="list tokens (ids, names and metadata, no secrets)")
    listing.add_argument("root", nargs="?", default=default_root())
    listing.add_argument("--tenant", default=None)
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(handler=_cmd_token_list)
    for parent in (actions, commands):
        whoami = parent.add_parser("whoami", help="who a token is: id, name, role, tenant, expiry")
        whoami.add_argument("root", nargs="?", default=default_root())
        whoami.add_argument(
            "--token-file", default="-", help="a file holding the token (default: stdin)"
        )
        whoami.add_argument("--json", action="store_true", help="print JSON")
        whoami.set_defaults(handler=_cmd_whoami)
    revoke = actions.add_parser("revoke", help="revoke a token by id")
    revoke.add_argument("token_id")
    revoke.add_argument("root", nargs="?", default=default_root())
    revoke.set_defaults(handler=_cmd_token_revoke)
    recover = actions.add_parser(
        "recover",
        help="mint an expiring operator token on the host (every operator token lost or revoked)",
    )
    recover.add_argument("root", nargs="?", default=default_root())
    recover.add_argument(
        "--ttl",
        type=float,
        default=BOOTSTRAP_TTL_SECONDS,
        help=f"lifetime in seconds (default {int(BOOTSTRAP_TTL_SECONDS)})",
    )
    recover.add_argument(
        "--out", default=None, help="write it to this new 0600 file (default: the terminal)"
    )
    recover.set_defaults(handler=_cmd_token_recover)
