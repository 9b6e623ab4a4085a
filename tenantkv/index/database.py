"""Engine and transactions of the metadata index (SQLite in WAL mode by default).

SQLite write transactions begin with ``BEGIN IMMEDIATE``: a deferred transaction that reads and
then writes can fail at once with SQLITE_BUSY when another connection wrote in between, whereas an
immediate one waits (``busy_timeout``) for the write lock. Read transactions stay deferred so
lookups never wait on writers (WAL lets readers run beside one writer).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, MetaData, create_engine, event, make_url, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from ..private_files import private_sqlite_files
from . import bounds
from .schema import DataKey, SchemaInfo
from .schema import Namespace as NamespaceRow

_BUSY_TIMEOUT_MS = 30000
_SCRUB_RETRY_S = 0.1
_IMMEDIATE = "tenantkv_immediate"
# PostgreSQL advisory locks, named per schema: "open" is held while a process creates or checks
# the index's tables and settings on opening, "ddl" while it creates tables; take_turns() names
# others.
_ADVISORY = "SELECT pg_advisory_{}(hashtext('tenantkv.{}:' || current_schema()))"
#: Seconds a new PostgreSQL connection may take: an unreachable server (a dropped route, a
#: firewall that drops packets) then fails an operation, which degrades to a miss, instead of
#: holding it for the operating system's TCP timeout (minutes).
_PG_CONNECT_TIMEOUT_S = 5


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
        cursor.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
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


@dataclass(frozen=True)
class LogScrub:
    """Whether :meth:`Database.scrub_log` made deletions final on disk, and what it found."""

    complete: bool
    detail: str


def _server_connect_args(url: str) -> tuple[dict[str, Any], str | None]:
    """Connection settings for a database server, and the ``application_name`` this cache's
    connections carry there.

    A name per cache (``tenantkv:<pid>:<random>``) shows in ``pg_stat_activity``, so an operator
    (or a test) can tell the nodes' connections apart and act on one node's alone. A name or
    timeout given in the URL's query wins.

    psycopg 3's automatic server-side prepared statements are off: a lookup's ``IN`` list of
    hundreds of keys, once prepared, ran on a generic plan several times slower than planning it
    afresh (bench/fleet.py: a 128K-token lookup took ~2x as long), and prepared statements break
    behind a PgBouncer in transaction mode, a common way to share a server among many nodes."""
    parsed = make_url(url)
    query = parsed.query
    args: dict[str, Any] = {}
    name = query.get("application_name")
    if name is None:
        name = f"tenantkv:{os.getpid()}:{secrets.token_hex(4)}"
        args["application_name"] = name
    if "connect_timeout" not in query:
        args["connect_timeout"] = _PG_CONNECT_TIMEOUT_S
    if parsed.get_driver_name() == "psycopg":  # psycopg 3's setting; psycopg2 never prepares
        args["prepare_threshold"] = None
    return args, name if isinstance(name, str) else None


class Database:
    """Owns the engines; hands out read and write sessions.

    On a server, the pool tests each connection before lending it (``pool_pre_ping``): after
    the server restarted or killed this node's backends, the next operation reconnects by
    itself; only operations already running when it went away fail (and degrade to a miss).

    With bounds (``serving_timeout``, ``admin_timeout``; ``tenantkv.index.bounds``), a PostgreSQL
    index gets two engines: one for the serving path (lookups, a load's plan, a store's index
    writes, lease writes: ``serving=True``), whose transactions end within the short bound, and
    one for everything else (administration and maintenance), within the long one; each pool's
    checkout waits no longer than its bound. Without bounds (schema upgrades, tools) nothing is
    bounded but new connections (``connect_timeout``). SQLite has no network: its busy timeout
    is the only wait, and one engine serves both kinds.
    """

    def __init__(
        self,
        url: str,
        *,
        serving_timeout: float | None = None,
        admin_timeout: float | None = None,
    ) -> None:
        self.url = url
        is_sqlite = url.startswith("sqlite")
        #: What this cache's connections are called on a PostgreSQL server (None on SQLite).
        self.application_name: str | None = None
        self._bounds: dict[bool, float | None] = {False: None, True: None}
        if is_sqlite:
            _private_database_file(url)
            self.engine = create_engine(url, connect_args={"check_same_thread": False})
            _configure_sqlite(self.engine)
            self.serving_engine = self.engine
        else:
            extra: dict[str, Any] = {}
            if url.startswith("postgresql"):
                extra, self.application_name = _server_connect_args(url)
                self._bounds = {False: admin_timeout, True: serving_timeout}
            self.engine = self._server_engine(url, extra, admin_timeout)
            self.serving_engine = (
                self.engine
                if serving_timeout is None
                else self._server_engine(url, extra, serving_timeout)
            )
        self._write_engines = {
            False: self.engine.execution_options(**{_IMMEDIATE: True}),
            True: self.serving_engine.execution_options(**{_IMMEDIATE: True}),
        }
        self._read_engines = {False: self.engine, True: self.serving_engine}
        self.dialect = self.engine.dialect.name

    @staticmethod
    def _server_engine(url: str, connect_args: dict[str, Any], bound: float | None) -> Engine:
        """An engine of a database server whose waits end within ``bound`` (None: unbounded
        but for new connections)."""
        if bound is None or not url.startswith("postgresql"):
            return create_engine(url, connect_args=connect_args, pool_pre_ping=True)
        query = make_url(url).query
        args = {**connect_args, **bounds.bounded_connect_args(bound, query)}
        engine = create_engine(url, connect_args=args, pool_pre_ping=True, pool_timeout=bound)
        bounds.install(engine, bound)
        return engine

    def bound(self, *, serving: bool = False) -> float | None:
        """Seconds an index transaction of this kind may take (None: unbounded)."""
        return self._bounds[serving]

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

    @contextlib.contextmanager
    def read(self, *, serving: bool = False) -> Iterator[Session]:
        """An ORM session in one read transaction; ``serving`` for the serving path's bound."""
        with (
            bounds.deadline(self._bounds[serving]),
            Session(self._read_engines[serving], expire_on_commit=False) as session,
            session.begin(),
        ):
            yield session

    @contextlib.contextmanager
    def read_connection(self, *, serving: bool = False) -> Iterator[Connection]:
        """A Core connection in one read transaction, for hot paths that need no ORM session
        (a load's plan); it is rolled back on exit. Its statements see one snapshot on SQLite;
        on PostgreSQL (READ COMMITTED) each statement sees its own, so what must agree is read
        in one statement (see plan_query.py)."""
        with (
            bounds.deadline(self._bounds[serving]),
            self._read_engines[serving].connect() as connection,
            connection.begin(),
        ):
            yield connection

    @contextlib.contextmanager
    def write_connection(self, *, serving: bool = False) -> Iterator[Connection]:
        """A Core connection in one write transaction (committed on a clean exit)."""
        with (
            bounds.deadline(self._bounds[serving]),
            self._write_engines[serving].connect() as connection,
            connection.begin(),
        ):
            yield connection

    @contextlib.contextmanager
    def write(self, *, serving: bool = False) -> Iterator[Session]:
        with (
            bounds.deadline(self._bounds[serving]),
            Session(self._write_engines[serving], expire_on_commit=False) as session,
            session.begin(),
        ):
            yield session

    def insert_ignoring_duplicates(self, table: Any) -> Any:
        """An INSERT that skips rows whose primary key exists (races between stores)."""
        if self.dialect == "sqlite":
            return sqlite.insert(table).on_conflict_do_nothing()
        if self.dialect == "postgresql":
            return postgresql.insert(table).on_conflict_do_nothing()
        raise NotImplementedError(f"database dialect {self.dialect!r} is not supported")

    def scrub_log(self, timeout: float = 2.0) -> LogScrub:
        """Make deletions final in the index's files, retrying for up to ``timeout`` seconds;
        say whether that succeeded.

        SQLite (``secure_delete`` zeroes deleted rows in their pages): checkpoint the
        write-ahead log into the database and truncate it, so the old page images that still
        hold deleted rows (a shredded tenant's wrapped keys) leave the ``-wal`` file. That
        cannot complete while another connection reads an older snapshot, which still needs
        those pages; the checkpoint's result row (busy, log, checkpointed) tells.

        PostgreSQL: ``VACUUM`` the key tables, which removes the deleted rows' dead tuples
        unless a transaction older than the deletion still runs; their count left afterwards
        (``pg_stat_user_tables.n_dead_tup``) tells. What VACUUM cannot reach (WAL segments,
        archives, replicas, backups, freed space not yet reused) is in docs/architecture.md.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.dialect == "sqlite":
                outcome = self._checkpoint(deadline)
            elif self.dialect == "postgresql":
                outcome = self._vacuum_key_tables()
            else:
                return LogScrub(False, f"no scrub for {self.dialect}")
            if outcome.complete or time.monotonic() >= deadline:
                return outcome
            time.sleep(_SCRUB_RETRY_S)

    def _checkpoint(self, deadline: float) -> LogScrub:
        # A raw connection: SQLAlchemy would wrap the pragma in a BEGIN. Its busy timeout is
        # lowered for the checkpoint, which otherwise waits 30 s for every reader to finish.
        connection = self.engine.raw_connection()
        try:
            cursor = connection.cursor()
            try:
                wait_ms = int(max(0.0, min(_SCRUB_RETRY_S, deadline - time.monotonic())) * 1000)
                cursor.execute(f"PRAGMA busy_timeout={wait_ms}")
                busy, log, done = cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            finally:
                cursor.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
                cursor.close()
        except sqlite3.Error as err:  # the deletion has committed: report, do not raise
            return LogScrub(False, f"the write-ahead log checkpoint failed: {err}")
        finally:
            connection.close()
        if busy or log != done:
            return LogScrub(
                False,
                f"the write-ahead log could not be truncated (busy={busy}, {done} of {log} "
                "pages checkpointed): another connection holds an older read snapshot",
            )
        return LogScrub(True, "write-ahead log checkpointed and truncated")

    def _vacuum_key_tables(self) -> LogScrub:
        tables = [DataKey.__tablename__, NamespaceRow.__tablename__]
        autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        with autocommit.connect() as connection:  # VACUUM cannot run in a transaction
            # Not behind another VACUUM (autovacuum) for long: scrub_log retries instead.
            connection.exec_driver_sql(f"SET lock_timeout = {int(_SCRUB_RETRY_S * 1000)}")
            try:
                for table in tables:
                    connection.exec_driver_sql(f'VACUUM "{table}"')
            except OperationalError as err:  # lock_timeout
                return LogScrub(False, f"VACUUM of the key tables waited too long: {err}")
            finally:
                connection.exec_driver_sql("RESET lock_timeout")
            left = connection.execute(
                text(
                    "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables "
                    "WHERE schemaname = current_schema() AND relname = ANY(:tables)"
                ),
                {"tables": tables},
            ).scalar_one()
        if left:
            return LogScrub(
                False,
                f"{left} dead row versions of key tables survived VACUUM: a transaction "
                "older than the deletion still runs",
            )
        return LogScrub(True, "key tables vacuumed")

    def schema_version(self) -> str | None:
        with self.read() as session:
            return session.scalar(
                select(SchemaInfo.value).where(SchemaInfo.name == "schema_version")
            )

    def close(self) -> None:
        self.engine.dispose()
        if self.serving_engine is not self.engine:
            self.serving_engine.dispose()
