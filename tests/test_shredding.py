"""Crypto-shredding reaches the index's files, or says that it has not yet.

A deleted tenant's (or a retired version's) wrapped keys must not stay readable on disk: with the
master key they would open a copied extent. A reader holding an old snapshot keeps them there
(SQLite: its pages stay in the ``-wal``; PostgreSQL: the dead tuples stay), so the scrub must
report itself incomplete, and a later one (the GC run) must finish the job.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

import tenantkv
from tenantkv import TenantKV
from tenantkv.index import tenants as tenant_rows
from tenantkv.index.schema import DataKey
from tenantkv.index.schema import Namespace as NamespaceRow
from tests.indexes import Index

from .helpers import MLA_SMALL, random_layers, random_tokens


def _open(cache_root: Path) -> TenantKV:
    return tenantkv.open(cache_root, durable=False)


def _wrapped_keys(kv: TenantKV, tenant: str, version: int | None = None) -> list[bytes]:
    """The tenant's wrapped data keys (one version, or all) and namespace keys, as stored."""
    with kv.context.index.read() as session:
        tenant_id = tenant_rows.id_of(session, tenant)
        assert tenant_id is not None
        query = session.query(DataKey.wrapped_key).filter(DataKey.tenant_id == tenant_id)
        if version is not None:
            return [row[0] for row in query.filter(DataKey.version == version)]
        namespaces = session.query(NamespaceRow.wrapped_hash_key).filter(
            NamespaceRow.tenant_id == tenant_id
        )
        return [row[0] for row in query] + [row[0] for row in namespaces]


def _sqlite_files(root: Path) -> dict[str, bytes]:
    return {
        suffix: (root / f"index.db{suffix}").read_bytes()
        for suffix in ("", "-wal", "-shm")
        if (root / f"index.db{suffix}").is_file()
    }


def _delete(kv: TenantKV) -> list[bytes]:
    """Delete tenant acme; return its wrapped keys as they were."""
    keys = _wrapped_keys(kv, "acme")
    kv.delete_tenant("acme")
    return keys


def _retire(kv: TenantKV) -> list[bytes]:
    """Retire acme's key version 1 (its extents are re-sealed under 2); return it wrapped."""
    keys = _wrapped_keys(kv, "acme", version=1)
    kv.rotate_keys("acme")
    assert kv.retire_keys("acme")["retired_versions"] == [1]
    return keys


SHREDDINGS: dict[str, Callable[[TenantKV], list[bytes]]] = {"delete": _delete, "retire": _retire}


def _setup(kv: TenantKV) -> None:
    for name in ("acme", "other"):
        kv.create_tenant(name)
        ns = kv.namespace(name, model="shred", layout=MLA_SMALL)
        assert ns.store(random_tokens(128, seed=3), random_layers(MLA_SMALL, 128, seed=3)) == 128


@pytest.mark.parametrize("how", sorted(SHREDDINGS))
def test_sqlite_reader_snapshot_keeps_shredded_keys_in_the_wal_until_a_later_scrub(
    cache_root: Path, index: Index, how: str
) -> None:
    if not index.is_sqlite:
        pytest.skip("the SQLite write-ahead log; PostgreSQL has its own test below")
    with _open(cache_root) as kv:
        _setup(kv)
        keys = _wrapped_keys(kv, "acme", version=1 if how == "retire" else None)
        assert keys
        files = b"".join(_sqlite_files(cache_root).values())
        assert all(key in files for key in keys)  # positive control: the search finds them
        reader = sqlite3.connect(cache_root / "index.db", isolation_level=None)
        try:
            reader.execute("BEGIN")
            assert reader.execute("SELECT count(*) FROM tkv_data_keys").fetchone()[0] >= 2
            shredded = SHREDDINGS[how](kv)
            assert shredded == keys
            health = kv.health_counters()
            assert health.get("scrub_pending") == 1 and health.get("incomplete_scrubs") == 1
            # The proof that the report is needed: the keys are still in the -wal file.
            wal = _sqlite_files(cache_root)["-wal"]
            assert all(key in wal for key in keys)
            if how == "retire":
                assert kv.retire_keys("acme")["scrub_complete"] is True  # nothing new to scrub
        finally:
            reader.rollback()
            reader.close()
        kv.gc()  # the GC run retries the pending scrub, which now completes
        health = kv.health_counters()
        assert health.get("scrub_pending") == 0 and health.get("incomplete_scrubs") == 1
        after = _sqlite_files(cache_root)
        assert after.get("-wal", b"") == b""  # truncated
        assert not any(key in data for key in keys for data in after.values())
        # The other tenant's keys were not touched (the search is not blind).
        assert all(key in b"".join(after.values()) for key in _wrapped_keys(kv, "other"))


@pytest.mark.parametrize("how", sorted(SHREDDINGS))
def test_sqlite_scrub_completes_at_once_without_a_reader(
    cache_root: Path, index: Index, how: str
) -> None:
    if not index.is_sqlite:
        pytest.skip("the SQLite write-ahead log")
    with _open(cache_root) as kv:
        _setup(kv)
        keys = SHREDDINGS[how](kv)
        assert "scrub_pending" in kv.health_counters()  # a scrub ran ...
        assert kv.health_counters()["scrub_pending"] == 0  # ... and completed
        assert "incomplete_scrubs" not in kv.health_counters()
        assert not any(key in data for key in keys for data in _sqlite_files(cache_root).values())


def _dead_key_tuples(url: str) -> int:
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            return int(
                connection.execute(
                    text(
                        "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables "
                        "WHERE schemaname = current_schema() "
                        "AND relname IN ('tkv_data_keys', 'tkv_namespaces')"
                    )
                ).scalar_one()
            )
    finally:
        engine.dispose()


def test_postgresql_old_snapshot_keeps_dead_key_tuples_until_a_later_vacuum(
    cache_root: Path, index: Index
) -> None:
    if index.is_sqlite:
        pytest.skip("PostgreSQL's dead tuples; SQLite has its own test above")
    url = index.url(cache_root)
    with _open(cache_root) as kv:
        _setup(kv)
        reader = create_engine(url, isolation_level="REPEATABLE READ")
        try:
            with reader.connect() as connection:
                # Positive control: the reader's snapshot sees acme's keys.
                seen = connection.execute(text("SELECT count(*) FROM tkv_data_keys")).scalar_one()
                assert seen == 2
                kv.delete_tenant("acme")
                health = kv.health_counters()
                assert health.get("scrub_pending") == 1 and health.get("incomplete_scrubs") == 1
                assert _dead_key_tuples(url) > 0  # what the report is about
                # The reader still reads the deleted keys: they are on disk.
                again = connection.execute(text("SELECT count(*) FROM tkv_data_keys"))
                assert again.scalar_one() == 2
        finally:
            reader.dispose()
        kv.gc()
        assert kv.health_counters().get("scrub_pending") == 0
        assert _dead_key_tuples(url) == 0
        with kv.context.index.read() as session:
            assert tenant_rows.id_of(session, "acme") is None
