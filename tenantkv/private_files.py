"""Owner-only directories and files for a cache's root and its SQLite index.

The root holds the index (tenant names, scopes, metering, the audit log, the token table), the
master key and the extents; any local user who can read it learns who uses the cache and how.
So the root is 0700 and every file in it 0600. Modes are set explicitly (``chmod`` after
``mkdir``/``open``) instead of through the umask, which is per process and would race with the
embedding server's other threads. A root or index file that group or others can reach is fixed
at open with a logged warning rather than refused: refusing would turn a permissions slip into
an outage, and the fix takes nothing away from the owner.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

logger = logging.getLogger("tenantkv")

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_OTHERS = stat.S_IRWXG | stat.S_IRWXO


def _tighten(path: Path, private: int) -> None:
    """Drop every group/other bit of ``path`` (keeping the owner's), warning when it had any."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & _OTHERS:
        logger.warning(
            "%s was accessible to group or others (mode %04o); changed to %04o",
            path,
            mode,
            (mode & ~_OTHERS) | (private & stat.S_IRWXU),
        )
        os.chmod(path, (mode & ~_OTHERS) | (private & stat.S_IRWXU))


def private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) as 0700, or make an existing one owner-only."""
    if not path.is_dir():
        path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        os.chmod(path, PRIVATE_DIR_MODE)  # mkdir's mode is filtered by the umask
        return
    _tighten(path, PRIVATE_DIR_MODE)


def private_file(path: Path) -> None:
    """Create ``path`` empty as 0600 if it is missing, or make an existing one owner-only.

    SQLite creates a database's ``-wal`` and ``-shm`` files with the mode of the database file,
    so creating ``index.db`` as 0600 before SQLite opens it keeps all three private.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    except FileExistsError:
        _tighten(path, PRIVATE_FILE_MODE)
        return
    os.close(fd)


def private_sqlite_files(database: Path) -> None:
    """Make a SQLite database file and its existing ``-wal``/``-shm``/``-journal`` owner-only
    (the database is created 0600 when missing)."""
    private_file(database)
    for suffix in ("-wal", "-shm", "-journal"):
        companion = database.with_name(database.name + suffix)
        if companion.exists():
            _tighten(companion, PRIVATE_FILE_MODE)
