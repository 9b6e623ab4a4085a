"""Local-filesystem block store (the embedded default; also any shared POSIX mount).

Layout under the root::

    extents/<first two hex digits>/<32 hex digits>.tkx   committed extents
    tmp/<32 hex digits>.part                              extents being written

A write goes to ``tmp/``, is flushed and fsynced, then renamed into ``extents/`` (rename is atomic
on POSIX file systems) and the directory is fsynced; so a reader sees either no extent or all of
it. Leftover ``.part`` files (a crash mid-write) are never visible as extents and are removed by
:meth:`LocalBlockStore.sweep_temporary`. A durable store writes the extent's whole pages with
``O_DIRECT`` into blocks reserved up front (see :class:`~.local_writer.LocalWriter`); the commit
is the same.

This module is the store: its layout, ids and settings. Writing one extent is
``local_writer.py``'s, reading one ``local_reader.py``'s (which also says when reads map), and
the directories' modes and fsyncs ``directories.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path

from .base import BlockStore, ExtentReader, ExtentWriter
from .directories import private_dir
from .errors import ExtentNotFoundError, StorageError
from .local_reader import MAPPABLE_FILE_SYSTEMS, MAPPED_SEGMENT_BYTES, LocalReader, file_system_type
from .local_writer import O_DIRECT, LocalWriter
from .recent_owners import OwnerRings, ring_settings
from .recent_writes import file_identity

__all__ = ["MAPPED_SEGMENT_BYTES", "LocalBlockStore", "file_system_type"]

_EXTENT_SUFFIX = ".tkx"
_ID_PATTERN = re.compile(r"[0-9a-f]{32}")

logger = logging.getLogger("tenantkv.storage")

#: The reader's name from before it had a module of its own (tests patch its methods here).
_LocalReader = LocalReader


class LocalBlockStore(BlockStore):
    """Extents as files under ``root``. ``durable=False`` skips fsync (tests, scratch caches).

    ``direct`` writes extents with ``O_DIRECT``, past the page cache (see
    :class:`~.local_writer.LocalWriter`); by default a durable store does, where the platform and
    file system allow it. A store does not then leave its extent in the page cache; with
    ``recent_bytes`` the store keeps the extents it wrote last in rings of that much memory,
    one per owner (``recent_owners.py``), so their first loads read memory, not the device.

    Every directory is owner-only (0700) and every file 0600; opening a store whose directories
    group or others can reach fixes them, with a logged warning.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        durable: bool = True,
        map_reads: bool | None = None,
        direct: bool | None = None,
        recent_bytes: int | None = 0,
        recent_owner_bytes: int | None = None,
    ) -> None:
        """``map_reads``: let loads decrypt straight out of mapped extents (see
        :meth:`ExtentReader.mapped`); default: on a local disk or memory file system, not on a
        network or FUSE mount; where extents are written ``direct``, only for segments of at
        least :data:`MAPPED_SEGMENT_BYTES`: the page cache then holds them in small pages, which
        loads read faster with ``preadv`` in small segments (docs/perf.md).
        ``direct``: write extents with ``O_DIRECT`` (default: when ``durable``).
        ``recent_bytes``: memory for the rings of recently written extents (only with
        ``direct``: otherwise the page cache holds them already); 0 keeps none, None derives
        it from the memory available (``recent_owners.default_capacity``).
        ``recent_owner_bytes``: one owner's ring (None: ``recent_owners.default_per_owner``)."""
        self.root = Path(root)
        self.durable = durable
        #: Whether new extents are written with O_DIRECT (False once the file system refused).
        self.direct = bool(O_DIRECT) and (durable if direct is None else direct)
        self.extent_dir = self.root / "extents"
        self.temp_dir = self.root / "tmp"
        for directory in (self.root, self.extent_dir, self.temp_dir):
            private_dir(directory)
        for shard in self.extent_dir.iterdir():
            if shard.is_dir():
                private_dir(shard)
        #: The smallest segment loads open out of a mapping (0: any; None: none are mapped).
        self.mapped_segment_bytes: int | None = 0 if map_reads else None
        if map_reads is None and file_system_type(self.root) in MAPPABLE_FILE_SYSTEMS:
            self.mapped_segment_bytes = MAPPED_SEGMENT_BYTES if self.direct else 0
        capacity, per_owner = ring_settings(recent_bytes, recent_owner_bytes)
        #: The rings of recently written extents, or None.
        self.recent = OwnerRings(capacity, per_owner) if capacity and self.direct else None

    @property
    def map_reads(self) -> bool:
        """Whether loads map extents whatever their segments' size."""
        return self.mapped_segment_bytes == 0

    def refuse_direct(self, reason: str) -> None:
        """Write buffered from now on: the file system under ``root`` refused O_DIRECT."""
        if self.direct:
            self.direct = False
            logger.warning("%s: %s; writing extents through the page cache", self.root, reason)

    def path_of(self, extent_id: str) -> Path:
        if not _ID_PATTERN.fullmatch(extent_id):
            raise ExtentNotFoundError(f"{extent_id!r} is not an extent id")
        return self.extent_dir / extent_id[:2] / f"{extent_id}{_EXTENT_SUFFIX}"

    def create(self, owner: str = "") -> ExtentWriter:
        try:
            return LocalWriter(self, secrets.token_hex(16), owner)
        except OSError as err:
            raise StorageError(f"creating extent failed: {err}") from err

    def create_as(self, extent_id: str, owner: str = "") -> ExtentWriter:
        self.path_of(extent_id)  # refuse a malformed id
        try:
            return LocalWriter(self, extent_id, owner)
        except OSError as err:  # FileExistsError: another writer has this id in flight
            raise StorageError(f"creating extent {extent_id} failed: {err}") from err

    def open(self, extent_id: str) -> ExtentReader:
        path = self.path_of(extent_id)
        if self.recent is not None:
            reader = self.recent.open(extent_id, lambda: file_identity(path))
            if reader is not None:
                return reader
        reader = LocalReader(path, map_from=self.mapped_segment_bytes)
        reader.start_cold()
        return reader

    def prefetch(self, extent_id: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Ask the kernel to read the ranges into the page cache (``POSIX_FADV_WILLNEED``),
        unless the ring of recent writes holds the extent (its loads read memory already)."""
        if self.recent is not None and self.recent.holds(extent_id):
            return
        try:
            fd = os.open(self.path_of(extent_id), os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, ExtentNotFoundError):
            return
        try:
            for offset, length in ranges:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # advisory only
        finally:
            os.close(fd)

    def delete(self, extent_id: str) -> bool:
        if self.recent is not None:
            self.recent.drop(extent_id)
        try:
            self.path_of(extent_id).unlink()
        except (FileNotFoundError, ExtentNotFoundError):
            return False
        except OSError as err:
            raise StorageError(f"deleting extent failed: {err}") from err
        return True

    def list(self) -> Iterator[str]:
        for shard in sorted(self.extent_dir.iterdir()):
            if not shard.is_dir():
                continue
            for entry in sorted(shard.iterdir()):
                stem = entry.name.removesuffix(_EXTENT_SUFFIX)
                if entry.name.endswith(_EXTENT_SUFFIX) and _ID_PATTERN.fullmatch(stem):
                    yield stem

    def close(self) -> None:
        if self.recent is not None:
            self.recent.close()

    def modified_at(self, extent_id: str) -> float:
        try:
            return self.path_of(extent_id).stat().st_mtime
        except FileNotFoundError:
            raise ExtentNotFoundError(f"no extent {extent_id}") from None

    def sweep_temporary(self, older_than: float | None = None) -> int:
        """Remove ``.part`` files left by crashed writers; return how many were removed.

        With ``older_than`` (epoch seconds) only files last written before it go, which is safe
        while writers run; without it, call this only when no writer of this root is running.
        """
        removed = 0
        for entry in self.temp_dir.glob("*.part"):
            with contextlib.suppress(FileNotFoundError):
                if older_than is not None and entry.stat().st_mtime > older_than:
                    continue
                entry.unlink()
                removed += 1
        return removed
