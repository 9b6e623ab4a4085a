"""``tenantkv db upgrade [ROOT]`` and ``tenantkv db current [ROOT]``: the index's schema
migrations, with the settings every other command uses (``config_for_root``: the root and the
``TENANTKV_*`` environment, ``TENANTKV_DATABASE_URL`` included).

``db upgrade`` refuses a root whose index holds no cache (``tenantkv init`` creates one) and
never creates a key file. These run on an index that may not open as a cache (an older schema
refuses to), so they call ``services.schema_upgrade`` directly rather than through an opened
``TenantKV``."""

from __future__ import annotations

import argparse
from typing import Any

from ..config import config_for_root, default_root, open_key_wrapper


def _cmd_upgrade(args: argparse.Namespace) -> int:
    from ..services.opening import holds_cache, not_found
    from ..services.schema_upgrade import upgrade_index

    config = config_for_root(args.root)
    if not holds_cache(config):  # a mistyped root: upgrading would create a cache there
        raise not_found(config)
    done = upgrade_index(config, open_key_wrapper(config, create_key_file=False))
    if done.before == done.after:
        print(f"index already at revision {done.after}: nothing to do")
    else:
        print(f"index upgraded from {done.before or 'before migrations'} to {done.after}")
    return 0


def _cmd_current(args: argparse.Namespace) -> int:
    from ..services.schema_upgrade import current_state, head_revision

    config = config_for_root(args.root)
    head = head_revision()
    state = current_state(config)
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
