"""Shared fixtures: a real cache on a temporary directory (local files + key file), its index on
SQLite and on PostgreSQL.

Every test that opens a cache requests ``index`` (directly, through ``cache_root``/``kv``, or with
``pytest.mark.usefixtures("index")``) and so runs once per index backend: ``[sqlite]`` (the
default ``<root>/index.db``) and ``[postgresql]`` (the server at ``TENANTKV_TEST_POSTGRES_URL``,
default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``). ``--index=sqlite|postgresql|both``
picks which (default both). On PostgreSQL each cache root gets a schema of its own, created on
first use and dropped, with every other schema of the session, when the session ends; so two
roots are two independent caches and reopening a root finds the same index, as on SQLite.

An unreachable PostgreSQL fails the ``[postgresql]`` tests rather than skipping them: a silent
skip would hide breakage. Run ``--index=sqlite`` to test without a server.

A test that opens a cache with the default index without requesting ``index`` fails at once,
so none runs on SQLite alone by omission.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import tenantkv
import tenantkv.config
from tenantkv import TenantKV
from tests.indexes import INDEX_KINDS, ORIGINAL_DEFAULT_URL, POSTGRES_URL, Index, PostgresSchemas

# Property tests check behaviour, not speed: on a shared or loaded host one example can take far
# longer than Hypothesis' default 200 ms deadline, and a slow generator trips its too_slow health
# check. Neither says anything about tenantkv, so the suite's profile turns both off; a test's own
# @settings still overrides the rest.
settings.register_profile("tenantkv", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("tenantkv")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--index",
        choices=("sqlite", "postgresql", "both"),
        default="both",
        help="index backend(s) the tests that open a cache run on (default: both)",
    )


def selected_index_kinds(config: pytest.Config) -> tuple[str, ...]:
    choice = config.getoption("index")
    return INDEX_KINDS if choice == "both" else (choice,)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "index" in metafunc.fixturenames:
        kinds = selected_index_kinds(metafunc.config)
        if metafunc.definition.get_closest_marker("one_index") is not None:
            kinds = kinds[:1]  # SQLite unless --index names one: its subject is not the index
        metafunc.parametrize("index", kinds, indirect=True)


def _patch_default_url(monkeypatch: pytest.MonkeyPatch, replacement: Callable[..., str]) -> None:
    """Replace ``default_database_url`` in ``tenantkv.config`` and in every tenantkv module that
    imported it by name."""
    replaced = {ORIGINAL_DEFAULT_URL, tenantkv.config.default_database_url}
    for name, module in list(sys.modules.items()):
        if (
            name.startswith("tenantkv.")
            and getattr(module, "default_database_url", None) in replaced
        ):
            monkeypatch.setattr(module, "default_database_url", replacement)


@pytest.fixture(scope="session")
def postgres_schemas() -> Iterator[PostgresSchemas]:
    schemas = PostgresSchemas(POSTGRES_URL)
    try:
        yield schemas
    finally:
        schemas.drop_all()


@pytest.fixture(scope="session")
def index(request: pytest.FixtureRequest) -> Iterator[Index]:
    """The index backend (parametrized: ``[sqlite]``, ``[postgresql]``); while it is active,
    ``tenantkv.open(root)`` puts the index of ``root`` there.

    Session-scoped, so that module-scoped fixtures can use it too; pytest then runs the tests of
    one backend together."""
    kind = getattr(request, "param", None)
    if kind not in INDEX_KINDS:
        raise RuntimeError("the index fixture is parametrized by pytest_generate_tests")
    if kind == "sqlite":
        yield Index(kind, None)
        return
    schemas: PostgresSchemas = request.getfixturevalue("postgres_schemas")
    schemas.connect()
    selected = Index(kind, schemas)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _patch_default_url(monkeypatch, lambda root: selected.url(root))
        yield selected


@pytest.fixture(autouse=True)
def _dev_null_stays_a_device() -> Iterator[None]:
    """Fail the test after which ``/dev/null`` is no longer the null device. The suite runs as
    root on the development machines and in CI: a test that once renamed a file onto
    ``/dev/null`` left every other program there unable to open it, and services' helpers that
    then spun made the rest of the run (and CI) ten times slower."""
    yield
    mode = os.stat("/dev/null").st_mode
    assert stat.S_ISCHR(mode), (
        "this test replaced /dev/null with a regular file; restore it as root with "
        "`rm /dev/null && mknod -m 666 /dev/null c 1 3`"
    )


@pytest.fixture(autouse=True)
def _default_index_needs_the_index_fixture(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a cache with the default index is an error in a test without ``index``."""
    if "index" in request.fixturenames:
        return

    def refuse(root: Path) -> str:
        raise AssertionError(
            f"{request.node.nodeid} opens a cache with the default index: request the `index` "
            "fixture (tests/conftest.py) so that it runs on SQLite and on PostgreSQL"
        )

    _patch_default_url(monkeypatch, refuse)


@pytest.fixture
def cache_root(tmp_path: Path, index: Index) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def kv(cache_root: Path) -> Iterator[TenantKV]:
    cache = tenantkv.open(cache_root, durable=False)
    try:
        yield cache
    finally:
        cache.close()
