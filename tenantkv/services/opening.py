"""Whether a root holds a cache, and undoing what a failed first opening created.

Opening used to create whatever it found missing: a mistyped root given to ``tenantkv serve``,
``token create`` or ``audit export`` became a new empty cache (a directory, an index, a fresh
``master.key``), and an opening that then failed left those behind. So an opening first asks
:func:`holds_cache`, without creating anything; only a caller that means to create a cache
(``tenantkv init``, the demos, the library's ``open(..., create=True)``) goes on when it says no,
and :class:`FirstOpening` removes what such an opening made if it fails before a cache exists.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from sqlalchemy import make_url
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from ..config import CacheConfig
from ..errors import CacheNotFoundError, CacheUnavailableError, InvalidRequestError
from ..index.failures import describe, shown_url
from .schema_upgrade import current_state

logger = logging.getLogger("tenantkv")

_SQLITE_COMPANIONS = ("", "-wal", "-shm", "-journal")


def check_root(root: Path) -> None:
    """Refuse, in one sentence, a root that cannot hold a cache: a file, or under one."""
    for path in (root, *root.parents):
        if path.exists():
            if not path.is_dir():
                what = "is" if path == root else f"is under {path}, which is"
                raise InvalidRequestError(f"the cache root {root} {what} a file, not a directory")
            return


def holds_cache(config: CacheConfig) -> bool:
    """Whether ``config``'s index holds a tenantkv cache (any of its tables or a revision).

    Looking creates nothing: a SQLite index file that does not exist is no cache, and is not
    connected to (connecting would create it). An index server that cannot be reached is a
    CacheUnavailableError, since it cannot say."""
    try:
        state = current_state(config)
    except OperationalError as err:
        url = shown_url(config.index_url)
        raise CacheUnavailableError(f"opening the index at {url} failed: {describe(err)}") from err
    return state is not None and not state.fresh


def not_found(config: CacheConfig) -> CacheNotFoundError:
    """The error for a root whose index holds no cache: one sentence naming the root (and a
    database URL given apart from it) and the command that creates a cache there."""
    where = str(config.root)
    if config.database_url is not None:
        url = shown_url(config.database_url)
        where = f"{where} (index {url})"
    return CacheNotFoundError(
        f"no tenantkv cache at {where}; check the path, or run `tenantkv init {config.root}` "
        "to create one"
    )


def _sqlite_file(config: CacheConfig) -> Path | None:
    url = config.index_url
    if not url.startswith("sqlite"):
        return None
    database = make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def _first_missing(path: Path) -> Path | None:
    """The outermost missing directory of ``path`` (what ``mkdir -p`` would create first)."""
    missing: Path | None = None
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            break
        missing = candidate
    return missing


class FirstOpening:
    """What an opening that may create a cache found missing, to remove again if it fails.

    Built before the opening touches anything. :meth:`undo` removes only paths that did not
    exist then, and only while the index still holds no cache: once it does (this opening
    created it before failing later, or another process opening the same root at the same time
    did), the index and its master key stay together, since one without the other could never
    be opened again and another process may already be using them. Files are removed by name
    and directories only when empty, so nothing another process put there meanwhile is lost.
    """

    def __init__(self, config: CacheConfig) -> None:
        self._config = config
        self._files: list[Path] = []
        self._dirs: list[Path] = []
        key_file = config.root / "master.key"
        candidates = [key_file, config.anchor_file]
        index_file = _sqlite_file(config)
        if index_file is not None:
            candidates += [index_file.with_name(index_file.name + s) for s in _SQLITE_COMPANIONS]
            self._note_dir(index_file.parent)
        if config.block_store_url is None:  # the default store: <root>/blocks
            self._note_dir(config.root / "blocks")
        self._note_dir(config.root)
        self._files = [path for path in candidates if not path.exists()]

    def _note_dir(self, directory: Path) -> None:
        top = _first_missing(directory)
        if top is not None and top not in self._dirs:
            self._dirs.append(top)

    def undo(self) -> None:
        """Remove what the failed opening created (best effort: a failure to remove is logged,
        never raised over the opening's own error)."""
        try:
            if holds_cache(self._config):
                return
        except (CacheUnavailableError, SQLAlchemyError, OSError) as err:
            logger.warning("a failed opening kept what it created: the index cannot say: %s", err)
            return
        for path in self._files:
            with contextlib.suppress(FileNotFoundError):
                try:
                    path.unlink()
                except OSError as err:
                    logger.warning("could not remove %s after a failed opening: %s", path, err)
        for top in self._dirs:
            _remove_empty_tree(top)


def _remove_empty_tree(top: Path) -> None:
    """Remove ``top`` and the directories under it, bottom up, each only if it is empty."""
    if not top.is_dir() or top.is_symlink():
        return
    for current, _dirs, _files in os.walk(top, topdown=False):
        with contextlib.suppress(OSError):  # not empty: someone else's files, kept
            os.rmdir(current)
