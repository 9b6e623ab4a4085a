"""Shared fixtures: a real cache on a temporary directory (SQLite + local files + key file)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import tenantkv
from tenantkv import TenantKV


@pytest.fixture
def cache_root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def kv(cache_root: Path) -> Iterator[TenantKV]:
    cache = tenantkv.open(cache_root, durable=False)
    try:
        yield cache
    finally:
        cache.close()
