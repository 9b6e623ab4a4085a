"""``tenantkv db upgrade [ROOT]`` and ``tenantkv db current [ROOT]``: the index's schema
migrations, with the settings every other command uses (``config_for_root``: the root and the
``TENANTKV_*`` environment, ``TENANTKV_DATABASE_URL`` included)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sqlalchemy import make_url

from ..config import config_for_root, default_root, open_key_wrapper
from ..index.migrate import head_revision
from ..services.schema_upgrade import current_state, upgrade_index


def _cmd_upgrade(args: argparse.Namespace) -> int:
    config = config_for_root(args.root)
    done = upgrade_index(config, open_key_wrapper(config))
    if done.before == done.after:
        print(f"index already at revision {done.after}: nothing to do")
    else:
        print(f"index upgraded from {done.before or 'before migrations'} to {done.after}")
    return 0


def _no_sqlite_file(url: str) -> bool:
    """Whether ``url`` names a SQLite file that does not exist (connecting would create it)."""
    database = make_url(url).database
    return url.startswith("sqlite") and bool(database) and not Path(str(database)).exists()


def _cmd_current(args: argparse.Namespace) -> int:
    config = config_for_root(args.root)
    head = head_revision()
    state = None if _no_sqlite_file(config.index_url) else current_state(config)
    if state is None or state.fresh:
        print(f"no index yet (this tenantkv creates revision {head})")
        return 0
    revision = state.revision or "none (from before migrations)"
    verdict = "up to date" if state.revision == head else f"upgrade to {head}: tenantkv db upgrade"
    if not state.known():
        verdict = f"newer than this tenantkv ({head})"
    print(f"{revision} ({verdict})")
    return 0


def register(commands: Any) -> None:
    """Add ``db`` and its subcommands to the ``tenantkv`` parser's subcommands."""
    db = commands.add_parser("db", help="the index's schema: upgrade, current revision")
    sub = db.add_subparsers(dest="db_command", required=True)
    upgrade = sub.add_parser("upgrade", help="run the index's schema migrations (idempotent)")
    upgrade.add_argument("root", nargs="?", default=default_root())
    upgrade.set_defaults(handler=_cmd_upgrade)
    current = sub.add_parser("current", help="show the index's schema revision")
    current.add_argument("root", nargs="?", default=default_root())
    current.set_defaults(handler=_cmd_current)
