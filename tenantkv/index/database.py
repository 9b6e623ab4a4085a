"""Engine and transactions of the metadata index (SQLite in WAL mode by default).

SQLite write transactions begin with ``BEGIN IMMEDIATE``: a deferred transaction that reads and
then writes can fail at once with SQLITE_BUSY when another connection wrote in between, whereas an
immediate one waits (``busy_timeout``) for the write lock. Read transactions stay deferred so
lookups never wait on writers (WAL lets readers run beside one writer).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, MetaData, create_engine, event, make_url, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ..audit import AuditBase
from ..private_files import private_sqlite_files
from .schema import Base, SchemaInfo

SCHEMA_VERSION = "1"
_IMMEDIATE = "tenantkv_immediate"
# PostgreSQL advisory locks, named per schema: "open" is held while a process creates or checks
# the index's tables and settings on opening, "ddl" while it creates tables; take_turns() names
# others.
_ADVISORY = "SELECT pg_advisory_{}(hashtext('tenantkv.{}:' || current_schema()))"


def _enable_wal(cursor: Any, timeout: float = 30.0) -> None:
    """Switch to WAL mode. On a new database file that takes a lock for which SQLite does not
    wait (busy_timeout does not apply), so connections opening a new index together retry."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        _enable_wal(cursor)
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        # Deleted rows (a crypto-shredded tenant's wrapped keys) are overwritten, not just freed.
        cursor.execute("PRAGMA secure_delete=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        immediate = connection.get_execution_options().get(_IMMEDIATE, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _private_database_file(url: str) -> None:
    """Create a SQLite index file 0600 before SQLite does (it would use 0644 less the umask, and
    give the -wal and -shm files the same mode), or make an existing one owner-only: the index
    holds tenant names, metering, the audit log and the token table."""
    database = make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    path = Path(database)
    if path.parent.is_dir():  # otherwise SQLite's own error says what is missing
        private_sqlite_files(path)


class Database:
    """Owns the engine; hands out read and write sessions."""

    def __init__(self, url: str) -> None:
        self.url = url
        is_sqlite = url.startswith("sqlite")
        connect_args: dict[str, Any] = {"check_same_thread": False} if is_sqlite else {}
        if is_sqlite:
            _private_database_file(url)
        self.engine = create_engine(url, connect_args=connect_args, pool_pre_ping=not is_sqlite)
        if is_sqlite:
            _configure_sqlite(self.engine)
        self._write_engine = self.engine.execution_options(**{_IMMEDIATE: True})
        self.dialect = self.engine.dialect.name

    def create_tables(self, *metadata: MetaData) -> None:
        """Create the missing tables of ``metadata``, one process at a time.

        Processes starting together on a new index would otherwise each find a table missing
        and create it: SQLite fails the deferred transaction that read first at once (BUSY,
        hence an immediate one here); on PostgreSQL the second CREATE TABLE fails with a
        duplicate key of pg_type (hence a lock per schema, released at commit).
        """
        with self.write_connection() as connection:
            self.take_turns(connection, "ddl")
            for each in metadata:
                each.create_all(connection)

    def take_turns(self, transaction: Session | Connection, name: str) -> None:
        """Wait for, and until the end of ``transaction`` exclude, every other write transaction
        that takes turns on ``name``. SQLite runs write transactions one at a time anyway; on
        PostgreSQL, where they run side by side, this is an advisory lock of the schema."""
        if self.dialect == "postgresql":
            transaction.execute(text(_ADVISORY.format("xact_lock", name)))

    @contextlib.contextmanager
    def opening(self) -> Iterator[None]:
        """Hold while opening: processes starting together on one index check or create its
        settings (schema version, master-key check, capacity) one after another.

        SQLite's write transactions are exclusive already; on PostgreSQL two processes could
        both find a setting missing and insert it, and one would fail on the duplicate key.
        """
        if self.dialect != "postgresql":
            yield
            return
        with self.engine.connect() as connection:
            connection.exec_driver_sql(_ADVISORY.format("lock", "open"))
            connection.commit()
            try:
                yield
            finally:
                connection.exec_driver_sql(_ADVISORY.format("unlock", "open"))
                connection.commit()

    def create_schema(self) -> None:
        self.create_tables(Base.metadata, AuditBase.metadata)
        with self.write() as session:
            row = session.get(SchemaInfo, "schema_version")
            if row is None:
                session.add(SchemaInfo(name="schema_version", value=SCHEMA_VERSION))
            elif row.value != SCHEMA_VERSION:
                raise RuntimeError(
                    f"index schema version {row.value} is not supported "
                    f"(this tenantkv writes version {SCHEMA_VERSION})"
                )

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

    @contextlib.contextmanager
    def read_connection(self) -> Iterator[Connection]:
        """A Core connection in one read transaction, for hot paths that need no ORM session
        (a load's plan); it is rolled back on exit. Its statements see one snapshot on SQLite;
        on PostgreSQL (READ COMMITTED) each statement sees its own, so what must agree is read
        in one statement (see plan_query.py)."""
        with self.engine.connect() as connection, connection.begin():
            yield connection

    @contextlib.contextmanager
    def write_connection(self) -> Iterator[Connection]:
        """A Core connection in one write transaction (committed on a clean exit)."""
        with self._write_engine.connect() as connection, connection.begin():
            yield connection

    @contextlib.contextmanager
    def write(self) -> Iterator[Session]:
        with Session(self._write_engine, expire_on_commit=False) as session, session.begin():
            yield session

    def insert_ignoring_duplicates(self, table: Any) -> Any:
        """An INSERT that skips rows whose primary key exists (races between stores)."""
        if self.dialect == "sqlite":
            return sqlite.insert(table).on_conflict_do_nothing()
        if self.dialect == "postgresql":
            return postgresql.insert(table).on_conflict_do_nothing()
        raise NotImplementedError(f"database dialect {self.dialect!r} is not supported")

    def scrub_log(self) -> None:
        """Make deletions final on disk: on SQLite, copy the write-ahead log into the database
        and truncate it, so deleted rows' old contents do not linger in the -wal file."""
        if self.dialect == "sqlite":
            with self.engine.connect() as connection:
                connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")

    def schema_version(self) -> str | None:
        with self.read() as session:
            return session.scalar(
                select(SchemaInfo.value).where(SchemaInfo.name == "schema_version")
            )

    def close(self) -> None:
        self.engine.dispose()
