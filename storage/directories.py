"""The directories of a local block store: owner-only, and made durable by fsync.

A module of its own since two others need it: the store (``local.py``), which creates its
directories, and its writer (``local_writer.py``), which creates extent shards and fsyncs them at
commit.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

PRIVATE_DIR = 0o700
_SHARED_BITS = stat.S_IRWXG | stat.S_IRWXO

logger = logging.getLogger("tenantkv.storage")


def private_dir(path: Path) -> None:
    """Create ``path`` owner-only (0700), or take group/other access away from an existing one
    (with a warning): extents are sealed, but their names, sizes and times still tell who
    cached how much and when."""
    if not path.is_dir():
        path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        os.chmod(path, PRIVATE_DIR)  # mkdir's mode is filtered by the umask
        return
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & _SHARED_BITS:
        logger.warning(
            "%s was accessible to group or others (mode %04o); changed to 0700", path, mode
        )
        os.chmod(path, (mode & ~_SHARED_BITS) | PRIVATE_DIR)


def fsync_dir(path: Path) -> None:
    """fsync a directory: a rename into it or an entry made in it survives a crash only then."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
