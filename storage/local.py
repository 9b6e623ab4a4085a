"""Local-filesystem block store (the embedded default; also any shared POSIX mount).

Layout under the root::

    extents/<first two hex digits>/<32 hex digits>.tkx   committed extents
    tmp/<32 hex digits>.part                              extents being written

A write goes to ``tmp/``, is flushed and fsynced, then renamed into ``extents/`` (rename is atomic
on POSIX file systems) and the directory is fsynced; so a reader sees either no extent or all of
it. Leftover ``.part`` files (a crash mid-write) are never visible as extents and are removed by
:meth:`LocalBlockStore.sweep_temporary`. A durable store writes the extent's whole pages with
``O_DIRECT`` into blocks reserved up front (see :class:`_LocalWriter`); the commit is the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import re
import secrets
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from typing_extensions import Buffer

from .base import BlockStore, ExtentReader, ExtentWriter
from .directories import PRIVATE_DIR, fsync_dir, private_dir
from .errors import ExtentNotFoundError, StorageError
from .local_reader import MAPPABLE_FILE_SYSTEMS, MAPPED_SEGMENT_BYTES, LocalReader, file_system_type
from .recent_writes import RecentWrites, Reservation, file_identity

__all__ = ["MAPPED_SEGMENT_BYTES", "LocalBlockStore", "file_system_type"]

_EXTENT_SUFFIX = ".tkx"
_ID_PATTERN = re.compile(r"[0-9a-f]{32}")
# O_DIRECT moves whole pages from page-aligned memory at page-aligned offsets; 4 KiB covers
# devices with 512-byte and 4 KiB logical blocks.
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_DIRECT_ALIGN = 4096
_BOUNCE_BYTES = 4 << 20


def _libc_fallocate() -> Any:
    """Linux ``fallocate(fd, mode, offset, len)`` with 64-bit offsets, or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return function


_FALLOCATE = _libc_fallocate()

logger = logging.getLogger("tenantkv.storage")

#: The reader's name from before it had a module of its own (tests patch its methods here).
_LocalReader = LocalReader


class _DirectPages:
    """Per-thread page-aligned memory for ``O_DIRECT`` writes: the scratch buffers handed to
    callers, and a bounce buffer for data that is not placed for the device."""

    def __init__(self) -> None:
        self.scratch: mmap.mmap | None = None
        self.bounce: mmap.mmap | None = None


_direct_pages = threading.local()


def _thread_pages() -> _DirectPages:
    pages: _DirectPages | None = getattr(_direct_pages, "pages", None)
    if pages is None:
        pages = _DirectPages()
        _direct_pages.pages = pages
    return pages


def _aligned(current: mmap.mmap | None, size: int) -> mmap.mmap:
    """``current`` if it holds ``size`` bytes, else a new page-aligned anonymous mapping (the
    old one is unmapped once nothing refers to it any more)."""
    if current is not None and len(current) >= size:
        return current
    return mmap.mmap(-1, max(1, -(-size // _DIRECT_ALIGN)) * _DIRECT_ALIGN)


def _address(view: memoryview) -> int | None:
    """The address of a writable view's first byte (None for read-only or empty views)."""
    if view.readonly or not view:
        return None
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


class _LocalWriter(ExtentWriter):
    """Writes one extent into ``tmp/`` and publishes it by rename.

    With ``direct`` the whole pages of each write go to the device with ``O_DIRECT``, not
    through the page cache: on the development VMs buffered writes of fresh pages ran at
    0.3-1.5 GB/s (every page-cache page a new allocation) against ~2 GB/s direct, and a large
    store no longer evicts other tenants' hot extents from the page cache (docs/perf.md).
    ``O_DIRECT`` moves whole 4 KiB pages from page-aligned memory: a write's aligned interior
    goes out from the caller's memory when :meth:`scratch` placed it (else through a bounce
    buffer). The pieces of the pages it covers only in part (under 4 KiB at each end) are kept
    in memory and written at commit through the page cache, on a second, buffered descriptor;
    those pages are never written directly, so the two paths never touch one page, and fsync
    (per file, not per descriptor) makes both durable. Written at once, a piece waited for
    whichever direct write held the inode lock (a third of the store's time here); written
    directly, each would cost a device round trip (~2 ms). A file system that refuses
    ``O_DIRECT`` gets buffered writes only (the same bytes, the same fsyncs).
    """

    def __init__(self, store: LocalBlockStore, extent_id: str) -> None:
        self._store = store
        self._id = extent_id
        self._temp = store.temp_dir / f"{self._id}.part"
        self._fd: int | None = os.open(
            self._temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
        )
        self._direct_fd: int | None = None  # open until commit or abort
        if store.direct:
            try:
                self._direct_fd = os.open(self._temp, os.O_WRONLY | os.O_CLOEXEC | _O_DIRECT)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    os.close(self._fd)
                    self._temp.unlink()
                    raise
                store.refuse_direct(f"opening with O_DIRECT failed: {err}")
        self._direct = self._direct_fd is not None  # False once a direct write was refused
        self._lock = threading.Lock()
        self._pieces: list[tuple[int, bytes]] = []  # (offset, bytes) of partly written pages
        self._appended = 0  # where :meth:`write` continues
        self._end = 0  # the end of the furthest non-empty write
        self._reserved = False
        self._done = False
        # The extent's region of the store's ring of recent writes (recent_writes.py), once
        # reserved, and how many bytes went into it (all of them, or the ring does not keep it).
        self._ring: Reservation | None = None
        self._ring_bytes = 0

    def reserve(self, size: int) -> None:
        """With direct writes, allocate the extent's blocks now (``fallocate(2)``, which also
        sets the file's size): direct writes into allocated blocks overwrite instead of
        extending the file, so they run side by side instead of one at a time under the inode
        lock (32K-token stores 0.76 -> 0.96 of the direct limit here), and a full disk fails
        here, before anything is sealed. Where the file system cannot, writes allocate as they
        go (no emulation: glibc's ``posix_fallocate`` would write every block)."""
        fd = self._fd
        ring = self._store.recent
        if ring is not None and self._ring is None and self._direct and not self._done:
            self._ring = ring.reserve(self._id, size)
        if fd is None or self._done or not self._direct or size <= 0 or _FALLOCATE is None:
            return
        if _FALLOCATE(fd, 0, ctypes.c_int64(0), ctypes.c_int64(size)) == 0:
            self._reserved = True  # the size is the writes' again at commit
            return
        code = ctypes.get_errno()
        if code in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        self.abort()
        raise StorageError(f"reserving {size} bytes for the extent failed: {os.strerror(code)}")

    def scratch(self, offset: int, size: int) -> memoryview:
        ring = self._ring
        if ring is not None and offset + size <= len(ring.view):
            # The extent's own place in the ring: page-aligned like the file, so the direct
            # writes go out from it, and kept for the first loads with no copy.
            return ring.view[offset : offset + size]
        if not self._direct:
            return super().scratch(offset, size)
        pages = _thread_pages()
        phase = offset % _DIRECT_ALIGN  # memory placed like the file: whole pages line up
        pages.scratch = _aligned(pages.scratch, phase + size)
        return memoryview(pages.scratch)[phase : phase + size]

    def write(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        with self._lock:
            offset = self._appended
            self._appended += len(view)
        self.write_at(offset, view)

    def write_at(self, offset: int, data: Buffer) -> None:
        fd = self._fd
        if fd is None or self._done:
            raise StorageError("extent writer is closed")
        view = memoryview(data).cast("B")
        end = offset + len(view)
        if view:
            with self._lock:
                self._end = max(self._end, end)
        first = -(-offset // _DIRECT_ALIGN) * _DIRECT_ALIGN  # first page boundary inside
        last = end // _DIRECT_ALIGN * _DIRECT_ALIGN  # last page boundary inside
        if self._ring is not None and view:
            self._keep_in_ring(offset, view)
        try:
            if not self._direct:
                _pwrite_all(fd, view, offset)
                return
            if last <= first:  # no whole page inside
                self._keep(offset, view)
                return
            self._keep(offset, view[: first - offset])
            self._keep(last, view[last - offset :])
            self._write_pages(first, view[first - offset : last - offset])
        except OSError as err:
            self._abort_file()  # the ring's region: at the owner's abort
            raise StorageError(f"writing extent failed: {err}") from err

    def _keep_in_ring(self, offset: int, view: memoryview) -> None:
        """Have the ring hold ``view`` at ``offset``: already so when it was written from the
        ring's own scratch memory, else copied in (a write past the region is not, so the
        extent is then not kept)."""
        ring = self._ring
        if ring is None:
            return
        end = offset + len(view)
        if end > len(ring.view):  # past its region: not kept (the bytes will not add up)
            return
        target = ring.view[offset:end]
        if _address(target) != _address(view):
            target[:] = view
        with self._lock:
            self._ring_bytes += len(view)

    def _keep(self, offset: int, piece: memoryview) -> None:
        """Keep a piece of a partly covered page for the commit (a copy: the caller reuses
        its buffer)."""
        if piece:
            data = bytes(piece)
            with self._lock:
                self._pieces.append((offset, data))

    def _write_pieces(self, fd: int) -> None:
        """Write the kept pieces through the page cache (after every direct write)."""
        with self._lock:
            pieces, self._pieces = self._pieces, []
        for offset, data in pieces:
            _pwrite_all(fd, memoryview(data), offset)

    def _write_pages(self, offset: int, pages: memoryview) -> None:
        """Write whole pages at a page-aligned ``offset`` with O_DIRECT: straight from
        ``pages`` when it is page-aligned in memory, else through this thread's bounce
        buffer."""
        address = _address(pages)
        if address is not None and address % _DIRECT_ALIGN == 0:
            self._pwrite_direct(pages, offset)
            return
        local = _thread_pages()
        local.bounce = _aligned(local.bounce, min(len(pages), _BOUNCE_BYTES))
        bounce = memoryview(local.bounce)
        for start in range(0, len(pages), len(bounce)):
            piece = pages[start : start + len(bounce)]
            bounce[: len(piece)] = piece
            self._pwrite_direct(bounce[: len(piece)], offset + start)

    def _pwrite_direct(self, view: memoryview, offset: int) -> None:
        fd = self._direct_fd
        if self._direct and fd is not None:
            try:
                _pwrite_all(fd, view, offset)
                return
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                # The file system took the open but not the write (it wants a larger
                # alignment): write buffered from now on; what went out directly is in the file.
                # (Other workers may still be writing through it: it stays open to commit.)
                self._store.refuse_direct(f"an O_DIRECT write failed: {err}")
                self._direct = False
        buffered = self._fd
        if buffered is None:
            raise OSError(errno.EBADF, "the extent writer was closed while it wrote")
        _pwrite_all(buffered, view, offset)

    def _close_direct(self) -> None:
        fd, self._direct_fd = self._direct_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def commit(self, *, retain_for: float | None = None) -> str:
        if self._fd is None or self._done:
            raise StorageError("extent writer is closed")
        final = self._store.path_of(self._id)
        try:
            self._write_pieces(self._fd)
            if self._reserved:
                os.ftruncate(self._fd, self._end)
            if self._store.durable:
                # fsync is per file, not per descriptor: it covers the direct writes'
                # allocations and the pages written through the page cache alike.
                os.fsync(self._fd)
            self._close_direct()
            os.close(self._fd)
            self._fd = None
            new_shard = not final.parent.exists()
            final.parent.mkdir(mode=PRIVATE_DIR, exist_ok=True)
            os.rename(self._temp, final)
            if self._store.durable:
                fsync_dir(final.parent)
                if new_shard:  # the shard's own entry must be durable too
                    fsync_dir(self._store.extent_dir)
        except OSError as err:
            self.abort()
            raise StorageError(f"committing extent failed: {err}") from err
        self._done = True
        self._publish_ring(final)
        return self._id

    def _publish_ring(self, final: Path) -> None:
        """After the commit: the ring keeps the extent when every byte of it went through the
        writer (writes never overlap, so the bytes written add up to its size)."""
        ring, self._ring = self._ring, None
        if ring is None:
            return
        try:
            identity = file_identity(final)
        except OSError:
            ring.abort()
            return
        if self._ring_bytes != self._end or identity[2] != self._end:
            ring.abort()
            return
        ring.commit(self._end, identity)

    def abort(self) -> None:
        # The ring's region is given back only here and at commit, where no worker writes any
        # more (the caller waits for its workers first), never from inside a failing write_at:
        # another worker may still be sealing into its scratch slice of the region.
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.abort()
        self._abort_file()

    def _abort_file(self) -> None:
        if self._done:
            return
        self._done = True
        self._close_direct()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with contextlib.suppress(FileNotFoundError):
            self._temp.unlink()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


class LocalBlockStore(BlockStore):
    """Extents as files under ``root``. ``durable=False`` skips fsync (tests, scratch caches).

    ``direct`` writes extents with ``O_DIRECT``, past the page cache (see :class:`_LocalWriter`);
    by default a durable store does, where the platform and file system allow it. A store does
    not then leave its extent in the page cache; with ``recent_bytes`` the store keeps the
    extents it wrote last in a ring of that much memory (``recent_writes.py``), so their first
    loads read memory, not the device.

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
        recent_bytes: int = 0,
    ) -> None:
        """``map_reads``: let loads decrypt straight out of mapped extents (see
        :meth:`ExtentReader.mapped`); default: on a local disk or memory file system, not on a
        network or FUSE mount; where extents are written ``direct``, only for segments of at
        least :data:`MAPPED_SEGMENT_BYTES`: the page cache then holds them in small pages, which
        loads read faster with ``preadv`` in small segments (docs/perf.md).
        ``direct``: write extents with ``O_DIRECT`` (default: when ``durable``).
        ``recent_bytes``: memory for the ring of recently written extents (only with
        ``direct``: otherwise the page cache holds them already); 0 keeps none."""
        self.root = Path(root)
        self.durable = durable
        #: Whether new extents are written with O_DIRECT (False once the file system refused).
        self.direct = bool(_O_DIRECT) and (durable if direct is None else direct)
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
        if recent_bytes < 0:
            raise ValueError("recent_bytes must not be negative")
        #: The ring of recently written extents, or None.
        self.recent = RecentWrites(recent_bytes) if recent_bytes and self.direct else None

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

    def create(self) -> ExtentWriter:
        try:
            return _LocalWriter(self, secrets.token_hex(16))
        except OSError as err:
            raise StorageError(f"creating extent failed: {err}") from err

    def create_as(self, extent_id: str) -> ExtentWriter:
        self.path_of(extent_id)  # refuse a malformed id
        try:
            return _LocalWriter(self, extent_id)
        except OSError as err:  # FileExistsError: another writer has this id in flight
            raise StorageError(f"creating extent {extent_id} failed: {err}") from err

    def open(self, extent_id: str) -> ExtentReader:
        path = self.path_of(extent_id)
        if self.recent is not None:
            reader = self.recent.open(extent_id, lambda: file_identity(path))
            if reader is not None:
                return reader
        return LocalReader(path, map_from=self.mapped_segment_bytes)

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
