"""File permissions of a cache root: the root and every directory in it 0700, every file 0600.

The index holds tenant names, scopes, metering, the audit log and the token table; with the
usual umask (0022) SQLite would create it, its ``-wal`` and ``-shm`` 0644 in a 0755 root, readable
by every local user. A root opened with group/other access is fixed, with a logged warning.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

import tenantkv
from tenantkv import TenantKV
from tests.indexes import Index

from .helpers import MLA_SMALL, random_layers, random_tokens


@pytest.fixture(autouse=True)
def _permissive_umask() -> Iterator[None]:
    """The common umask, which lets group and others read what is created with default modes:
    the modes checked here are then the ones the cache sets, not the umask's."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _fill(kv: TenantKV) -> None:
    """A tenant, a stored prefix and an index write still in the WAL (the cache stays open)."""
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="perm", layout=MLA_SMALL)
    tokens = random_tokens(128, seed=1)
    assert ns.store(tokens, random_layers(MLA_SMALL, 128, seed=1)) == 128


def _everything(root: Path) -> list[Path]:
    return [root, *sorted(root.rglob("*"))]


def _not_private(root: Path) -> list[str]:
    """Everything under ``root`` that group or others can access, with its mode."""
    return [
        f"{path.relative_to(root.parent)} {_mode(path):04o}"
        for path in _everything(root)
        if _mode(path) & (stat.S_IRWXG | stat.S_IRWXO)
    ]


def test_a_fresh_cache_is_private(cache_root: Path, index: Index) -> None:
    with tenantkv.open(cache_root, durable=False) as kv:
        _fill(kv)
        names = {path.name for path in _everything(cache_root)}
        # The check covers the files that matter (the WAL is there while the cache is open).
        expected = {"master.key", "blocks", "extents", "tmp"}
        if index.is_sqlite:
            expected |= {"index.db", "index.db-wal", "index.db-shm"}
        assert expected <= names, sorted(names)
        assert any(path.suffix == ".tkx" for path in cache_root.rglob("*"))
        assert _not_private(cache_root) == []
        assert _mode(cache_root) == 0o700
        for path in _everything(cache_root):
            assert _mode(path) == (0o700 if path.is_dir() else 0o600), path


def test_opening_a_readable_root_fixes_it_with_a_warning(
    cache_root: Path, index: Index, caplog: pytest.LogCaptureFixture
) -> None:
    with tenantkv.open(cache_root, durable=False) as kv:
        _fill(kv)
    # As an older version (or an operator's cp -r) left it: world-readable.
    for path in _everything(cache_root):
        if path.name != "master.key":  # a readable key file is refused, not fixed (test_crypto)
            path.chmod(0o755 if path.is_dir() else 0o644)
    opened = _not_private(cache_root)  # positive control: the chmod did make them readable
    assert f"cache {0o755:04o}" in opened
    if index.is_sqlite:
        assert f"cache/index.db {0o644:04o}" in opened
    assert any(entry.startswith("cache/blocks/extents/") for entry in opened)
    with (
        caplog.at_level(logging.WARNING, logger="tenantkv"),
        tenantkv.open(cache_root, durable=False) as kv,
    ):
        ns = kv.namespace("acme", model="perm", layout=MLA_SMALL)
        assert ns.lookup(random_tokens(128, seed=1)) == 128  # the owner still has its data
        # Directories are fixed; files inside a 0700 root are out of others' reach, and the
        # index's files are made 0600 too.
        assert _mode(cache_root) == 0o700
        for path in _everything(cache_root):
            if path.is_dir():
                assert _mode(path) == 0o700, path
        if index.is_sqlite:
            for suffix in ("", "-wal", "-shm"):
                assert _mode(cache_root / f"index.db{suffix}") == 0o600, suffix
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(cache_root) in message and "0755" in message for message in warned), warned
