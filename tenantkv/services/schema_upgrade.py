"""``tenantkv db upgrade`` and ``db current``: the index's schema migrations run by an operator,
with the cache's own settings (``CacheConfig``: the database URL, the master key, the anchor
file), and the command a refused opening names.

Upgrading needs the master key: an index from before audit MACs has its chain heads MACed in the
upgrade's transaction (``AuditLog.seal_upgraded``), and a wrong key would seal them under a key
no node has. So the key is checked against the index first, and a wrong one changes nothing.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import inspect, make_url
from sqlalchemy.exc import OperationalError

from ..audit import AuditLog
from ..config import CacheConfig
from ..crypto import KeyWrapper, SealOpenError
from ..errors import CacheUnavailableError, MasterKeyError
from ..index import migrate, settings
from ..index.database import Database
from ..index.failures import describe, shown_url
from ..index.schema import SchemaInfo

KEY_CHECK_CONTEXT = b"tenantkv/master-key-check"


def upgrade_command(config: CacheConfig) -> str:
    """The shell command that upgrades ``config``'s index (what a refused opening names): the
    database URL, without its password, in front when the index is not the root's default."""
    command = f"tenantkv db upgrade {shlex.quote(str(config.root))}"
    if config.database_url is None:
        return command
    url = make_url(config.database_url).render_as_string(hide_password=True)
    return f"TENANTKV_DATABASE_URL={shlex.quote(url)} {command}"


def verify_master_key(stored_hex: str, wrapper: KeyWrapper) -> None:
    """Refuse a master key that does not open the index's key check (:class:`MasterKeyError`)."""
    try:
        wrapper.unwrap(bytes.fromhex(stored_hex), KEY_CHECK_CONTEXT)
    except SealOpenError:
        raise MasterKeyError("the master key does not open this cache's index") from None


def _check_key(index: Database, wrapper: KeyWrapper) -> None:
    with index.read() as session:
        if not inspect(session.connection()).has_table(SchemaInfo.__tablename__):
            return  # a fresh index: the first opening stores the check
        stored = settings.get(session, settings.MASTER_KEY_CHECK)
    if stored is not None:
        verify_master_key(stored, wrapper)


def upgrade_index(
    config: CacheConfig, wrapper: KeyWrapper, clock: Callable[[], float] = time.time
) -> migrate.Upgrade:
    """Bring ``config``'s index to this tenantkv's head revision (a no-op if it is there)."""
    index = Database(config.index_url)
    try:
        _check_key(index, wrapper)
        audit = AuditLog(wrapper, clock=clock, anchor_path=config.anchor_file)
        return migrate.upgrade(index, audit)
    finally:
        index.close()


def head_revision() -> str:
    """The schema revision this tenantkv creates and upgrades to."""
    return migrate.head_revision()


def _no_sqlite_file(url: str) -> bool:
    """Whether ``url`` names a SQLite file that does not exist (connecting would create it)."""
    database = make_url(url).database
    return url.startswith("sqlite") and bool(database) and not Path(str(database)).exists()


def current_state(config: CacheConfig) -> migrate.SchemaState | None:
    """The revision ``config``'s index is at; None for a SQLite file that does not exist yet
    (looking must not create it)."""
    if _no_sqlite_file(config.index_url):
        return None
    index = Database(config.index_url)
    try:
        return migrate.current_revision(index)
    except OperationalError as err:  # a server down or refusing: a sentence, not a traceback
        url = shown_url(config.index_url)
        raise CacheUnavailableError(f"opening the index at {url} failed: {describe(err)}") from err
    finally:
        index.close()
