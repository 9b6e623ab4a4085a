"""The index backends the tests run on: SQLite files under a cache root, or schemas of this test
session on a PostgreSQL server (one per cache root). See ``conftest.py`` for the ``index`` fixture.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import tenantkv.config

INDEX_KINDS = ("sqlite", "postgresql")
POSTGRES_URL = os.environ.get(
    "TENANTKV_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
ORIGINAL_DEFAULT_URL = tenantkv.config.default_database_url

# Runs `tenantkv.cli` in a child process with the index of every root at the URL given first.
_CLI_WITH_URL = (
    "import runpy, sys\n"
    "import tenantkv.config\n"
    "url = sys.argv.pop(1)\n"
    "tenantkv.config.default_database_url = lambda root: url\n"
    "sys.argv[0] = 'tenantkv'\n"
    "runpy.run_module('tenantkv.cli', run_name='__main__', alter_sys=True)\n"
)


class PostgresSchemas:
    """This session's schemas on the PostgreSQL server: one per cache root (or name)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.prefix = f"tkv_{secrets.token_hex(4)}_"
        self._schemas: dict[str, str] = {}
        self._lock = threading.Lock()
        self._engine: Any = None

    def connect(self) -> None:
        """Fail (not skip) the PostgreSQL tests when the server cannot be used."""
        if self._engine is not None:
            return
        how = "run with --index=sqlite to test without PostgreSQL"
        if importlib.util.find_spec("psycopg") is None:
            pytest.fail(
                f"psycopg (the PostgreSQL driver) is not installed; pip install "
                f"'psycopg[binary]>=3.2', or {how}",
                pytrace=False,
            )
        from sqlalchemy import create_engine
        from sqlalchemy.exc import OperationalError

        engine = create_engine(self.base_url, pool_size=2, max_overflow=0)
        try:
            with engine.connect() as connection:
                connection.exec_driver_sql("SELECT 1")
        except OperationalError as err:
            engine.dispose()
            pytest.fail(f"PostgreSQL at {self.base_url} is not reachable ({how}): {err}", False)
        self._engine = engine

    def url(self, key: str) -> str:
        """The URL of the schema of ``key`` (created on first use): the same key, the same one."""
        with self._lock:
            schema = self._schemas.get(key)
            if schema is None:
                schema = f"{self.prefix}{len(self._schemas) + 1}"
                with self._engine.begin() as connection:
                    connection.exec_driver_sql(f"CREATE SCHEMA {schema}")
                self._schemas[key] = schema
        return f"{self.base_url}?options=-csearch_path%3D{schema}"

    def dump(self, url: str) -> bytes:
        """Every value of every row of every table of the schema of ``url``, as stored: bytea
        as its bytes, text as UTF-8, anything else as its text."""
        schema = url.rpartition("search_path%3D")[2]
        assert schema in self._schemas.values(), f"{url} is not a schema of this session"
        parts: list[bytes] = []
        with self._engine.connect() as connection:
            tables = connection.exec_driver_sql(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %(s)s",
                {"s": schema},
            ).scalars()
            for table in list(tables):
                for row in connection.exec_driver_sql(f'SELECT * FROM {schema}."{table}"'):
                    for value in row:
                        if isinstance(value, bytes | bytearray | memoryview):
                            parts.append(bytes(value))
                        elif isinstance(value, str):
                            parts.append(value.encode())
                        else:
                            parts.append(str(value).encode())
        return b"\n".join(parts)

    def drop_all(self) -> None:
        if self._engine is None:
            return
        with self._engine.connect() as connection:
            for schema in self._schemas.values():
                with connection.begin():
                    # A cache a test left open could hold locks: fail instead of hanging.
                    connection.exec_driver_sql("SET LOCAL lock_timeout = '10s'")
                    connection.exec_driver_sql(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        self._engine.dispose()


class Index:
    """The index backend of one test: where a cache root's index lives, and how to reach it."""

    def __init__(self, kind: str, schemas: PostgresSchemas | None) -> None:
        self.kind = kind
        self._schemas = schemas

    @property
    def is_sqlite(self) -> bool:
        return self.kind == "sqlite"

    def url(self, root: str | os.PathLike[str]) -> str:
        """The index URL of the cache rooted at ``root`` (what ``tenantkv.open(root)`` uses)."""
        if self._schemas is None:
            return ORIGINAL_DEFAULT_URL(Path(root))
        return self._schemas.url(str(Path(root).resolve()))

    def database_url(self, name: str | os.PathLike[str]) -> str:
        """A database of its own for a test that builds a ``Database`` directly: a SQLite file
        at ``name``, or the PostgreSQL schema of that name."""
        if self._schemas is None:
            return f"sqlite:///{name}"
        return self._schemas.url(f"db:{Path(name).resolve()}")

    def cli(self, *args: str) -> list[str]:
        """A command running ``tenantkv`` in a child process on this backend (on PostgreSQL,
        every root the child opens shares one fresh schema)."""
        if self._schemas is None:
            return [sys.executable, "-m", "tenantkv.cli", *args]
        url = self._schemas.url(f"cli:{secrets.token_hex(8)}")
        return [sys.executable, "-c", _CLI_WITH_URL, url, *args]

    def stored_bytes(self, url: str) -> bytes:
        """What the index at ``url`` keeps at rest, to search for leaks: on SQLite the bytes of
        its files (database, write-ahead log, shared memory); on PostgreSQL, whose files are the
        server's, every value of every row of the schema as the server returns it."""
        if self._schemas is None:
            path = Path(url.removeprefix("sqlite:///"))
            files = [path.with_name(path.name + suffix) for suffix in ("", "-wal", "-shm")]
            return b"".join(f.read_bytes() for f in files if f.is_file())
        return self._schemas.dump(url)

    def examples(self, count: int) -> int:
        """How many examples a property test runs here: ``count`` on SQLite, a third of it on
        PostgreSQL. A fresh cache there costs a schema, and every statement a round trip, so
        each example takes about three times as long; the properties themselves do not depend on
        the index, and SQLite runs them in full."""
        return count if self.is_sqlite else max(1, count // 3)

    def __repr__(self) -> str:
        return f"Index({self.kind!r})"
