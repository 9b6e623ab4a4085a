"""Schema revisions of the index (Alembic), and the check every opening makes.

The index's tables (``schema.py``), the admin token and inference key tables (``api_tokens.py``,
``inference_keys.py``) and the audit tables (``tenantkv.audit``) share one database and one
revision, kept in Alembic's ``alembic_version`` table. The scripts ship inside the package
(``migrations/``) and run on a connection this module hands over, so no ``alembic.ini`` is
needed at run time.

* :func:`ensure_current` (every opening): a fresh index gets today's tables from the models and is
  stamped at the head revision, so a later upgrade starts at the right place; an index at the
  head is used as it is; anything else (an older revision, an index from before migrations, a
  revision this tenantkv does not know) is refused without a change. Opening never alters tables:
  one node of a fleet must not change the schema under the others' feet.
* :func:`upgrade` (``tenantkv db upgrade``): runs the missing revisions.

Both run in one write transaction holding the index's ``ddl`` turn (an advisory lock of the
schema on PostgreSQL; SQLite's write lock), so nodes opening or upgrading together take turns,
and a failed upgrade leaves the index as it was (DDL is transactional on both dialects).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, MetaData, insert, inspect

from ..audit import AuditBase, AuditLog
from ..errors import SchemaVersionError
from .api_tokens import ServerBase
from .database import Database
from .inference_keys import InferenceKey
from .jobs import Job
from .migrations.versions.identity_audit_macs import AUDIT_LOG
from .schema import Base, SchemaInfo

_SCRIPTS: Final = Path(__file__).with_name("migrations")
#: The value of the ``schema_version`` setting (from before migrations; kept for ``info``).
LEGACY_SCHEMA_VERSION: Final = "1"
_METADATA: Final[tuple[MetaData, ...]] = (Base.metadata, ServerBase.metadata, AuditBase.metadata)
assert InferenceKey.__tablename__ in ServerBase.metadata.tables  # imported for its table
assert Job.__tablename__ in ServerBase.metadata.tables  # imported for its table


def _config(connection: Connection | None = None, audit: AuditLog | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(_SCRIPTS))
    config.attributes["connection"] = connection
    if audit is not None:
        config.attributes[AUDIT_LOG] = audit
    return config


@functools.cache
def scripts() -> ScriptDirectory:
    """The revisions (read once per process: every opening checks the head)."""
    return ScriptDirectory.from_config(_config())


def head_revision() -> str:
    head = scripts().get_current_head()
    assert head is not None, "the migration scripts have no head revision"
    return head


def all_metadata() -> tuple[MetaData, ...]:
    """Every declarative base whose tables live in the index (what a fresh index creates)."""
    return _METADATA


@dataclass(frozen=True)
class SchemaState:
    """What an index's database holds: its stamped revision, and whether any of its tables
    exist (an index from before migrations has tables and no revision)."""

    revision: str | None
    has_tables: bool

    @property
    def fresh(self) -> bool:
        return self.revision is None and not self.has_tables

    def known(self) -> bool:
        """Whether this tenantkv's scripts know the revision (a newer one's do not)."""
        if self.revision is None:
            return True
        try:
            return scripts().get_revision(self.revision) is not None
        except CommandError:
            return False

    def describe(self) -> str:
        if self.revision is None:
            return "predates schema migrations (milestone-1 tables, no revision)"
        return f"is at schema revision {self.revision!r}"


def read_state(connection: Connection) -> SchemaState:
    present = set(inspect(connection).get_table_names())
    ours = {name for metadata in _METADATA for name in metadata.tables}
    revision = MigrationContext.configure(connection).get_current_revision()
    return SchemaState(revision=revision, has_tables=bool(present & ours))


def current_revision(index: Database) -> SchemaState:
    with index.read_connection() as connection:
        return read_state(connection)


def _create_fresh(connection: Connection, head: str) -> None:
    """Today's tables from the models, stamped at ``head`` (the revisions would make the same:
    tests/test_migrations.py compares them)."""
    for metadata in _METADATA:
        metadata.create_all(connection)
    connection.execute(
        insert(SchemaInfo).values(name="schema_version", value=LEGACY_SCHEMA_VERSION)
    )
    command.stamp(_config(connection), head)


def ensure_current(index: Database, upgrade_command: str) -> None:
    """Create and stamp a fresh index, accept one at the head revision, refuse anything else
    (:class:`SchemaVersionError`, naming ``upgrade_command``) and change nothing then."""
    head = head_revision()
    with index.write_connection() as connection:
        index.take_turns(connection, "ddl")
        state = read_state(connection)
        if state.revision == head:
            return
        if state.fresh:
            _create_fresh(connection, head)
            return
    if not state.known():
        raise SchemaVersionError(
            f"the index {state.describe()}, which this tenantkv does not know (its head is "
            f"{head!r}): it was upgraded by a newer tenantkv; use that version (tenantkv does "
            "not downgrade an index)"
        )
    raise SchemaVersionError(
        f"the index {state.describe()}, older than this tenantkv's ({head!r}); nothing was "
        f"changed. Upgrade it first: {upgrade_command}"
    )


@dataclass(frozen=True)
class Upgrade:
    """The revisions before and after :func:`upgrade` (equal: nothing to do)."""

    before: str | None
    after: str


def upgrade(index: Database, audit: AuditLog) -> Upgrade:
    """Run the revisions an index lacks, in one transaction holding the ``ddl`` turn; a fresh
    index is created as :func:`ensure_current` creates it. ``audit`` (built on the cache's master
    key and anchor file) seals the heads of an audit log from before MACs."""
    head = head_revision()
    with index.opening(), index.write_connection() as connection:
        index.take_turns(connection, "ddl")
        state = read_state(connection)
        if not state.known():
            raise SchemaVersionError(
                f"the index {state.describe()}, newer than this tenantkv's ({head!r}); "
                "tenantkv does not downgrade an index"
            )
        if state.fresh:
            _create_fresh(connection, head)
        elif state.revision != head:
            command.upgrade(_config(connection, audit), head)
    return Upgrade(before=state.revision, after=head)
