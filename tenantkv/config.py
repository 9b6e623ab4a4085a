"""Where a cache keeps its parts by default.

The index defaults to SQLite beside the extents, under the cache's root; one function says so,
so that every entry point (the library, the CLI, the admin service) agrees.
"""

from __future__ import annotations

from pathlib import Path


def default_database_url(root: Path) -> str:
    """The index of a cache rooted at ``root`` when no ``database_url`` is given."""
    return f"sqlite:///{root / 'index.db'}"
