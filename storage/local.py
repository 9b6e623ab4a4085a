"""Local-filesystem block store (the embedded default; also any shared POSIX mount).

Layout under the root::

    extents/<first two hex digits>/<32 hex digits>.tkx   committed extents
    tmp/<32 hex digits>.part                              extents being written

A write goes to ``tmp/``, is flushed and fsynced, then renamed into ``extents/`` (rename is atomic
on POSIX file systems) and the directory is fsynced; so a reader sees either no extent or all of
it. Leftover ``.part`` files (a crash mid-write) are never visible as extents and are removed by
:meth:`LocalBlockStore.sweep_temporary`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from typing_extensions import Buffer

from .base import BlockStore, ExtentReader, ExtentWriter
from .errors import ExtentNotFoundError, ShortReadError, StorageError

_EXTENT_SUFFIX = ".tkx"
_ID_PATTERN = re.compile(r"[0-9a-f]{32}")
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
_PRIVATE_DIR = 0o700
# O_DIRECT moves whole pages from page-aligned memory at page-aligned offsets; 4 KiB covers
# devices with 512-byte and 4 KiB logical blocks.
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_DIRECT_ALIGN = 4096
_BOUNCE_BYTES = 4 << 20
_SHARED_BITS = stat.S_IRWXG | stat.S_IRWXO

logger = logging.getLogger("tenantkv.storage")


def _private_dir(path: Path) -> None:
    """Create ``path`` owner-only (0700), or take group/other access away from an existing one
    (with a warning): extents are sealed, but their names, sizes and times still tell who
    cached how much and when."""
    if not path.is_dir():
        path.mkdir(mode=_PRIVATE_DIR, parents=True, exist_ok=True)
        os.chmod(path, _PRIVATE_DIR)  # mkdir's mode is filtered by the umask
        return
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & _SHARED_BITS:
        logger.warning(
            "%s was accessible to group or others (mode %04o); changed to 0700", path, mode
        )
        os.chmod(path, (mode & ~_SHARED_BITS) | _PRIVATE_DIR)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class _PartialPage:
    """The bytes written so far into one file page that no single write covered whole."""

    __slots__ = ("data", "filled", "ranges")

    def __init__(self) -> None:
        self.data = bytearray(_DIRECT_ALIGN)
        self.filled = 0
        self.ranges: list[tuple[int, int]] = []


class _LocalWriter(ExtentWriter):
    """Writes one extent into ``tmp/`` and publishes it by rename.

    With ``direct`` the file is opened ``O_DIRECT``: bytes go from the caller's memory to the
    device, not through the page cache. On the development VMs buffered writes of fresh pages ran
    at 0.3-1.5 GB/s (every page-cache page a new allocation) against ~2 GB/s direct, and a large
    store no longer evicts other tenants' hot extents from the page cache (docs/perf.md). Direct
    I/O moves whole 4 KiB pages from page-aligned memory: the aligned interior of each write goes
    out at once (from the caller's memory when :meth:`scratch` placed it, else through a bounce
    buffer); the pieces of pages that a write covers only in part are collected here and written
    when the page is complete, or at commit. A file system that refuses ``O_DIRECT`` gets
    buffered writes instead (the same bytes, the same fsyncs).
    """

    def __init__(self, store: LocalBlockStore, extent_id: str) -> None:
        self._store = store
        self._id = extent_id
        self._temp = store.temp_dir / f"{self._id}.part"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        self._direct = bool(store.direct and _O_DIRECT)
        fd: int | None = None
        if self._direct:
            try:
                fd = os.open(self._temp, flags | _O_DIRECT, 0o600)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                store.refuse_direct(f"opening with O_DIRECT failed: {err}")
                self._direct = False
        self._fd: int | None = fd if fd is not None else os.open(self._temp, flags, 0o600)
        self._lock = threading.Lock()
        self._pages: dict[int, _PartialPage] = {}
        self._size = 0  # the end of the furthest region written
        self._appended = 0  # where :meth:`write` continues
        self._done = False

    def scratch(self, offset: int, size: int) -> memoryview:
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
        try:
            if self._direct:
                self._write_direct(fd, offset, view)
            else:
                _pwrite_all(fd, view, offset)
        except OSError as err:
            self.abort()
            raise StorageError(f"writing extent failed: {err}") from err
        with self._lock:
            self._size = max(self._size, end)

    def _write_direct(self, fd: int, offset: int, view: memoryview) -> None:
        end = offset + len(view)
        first = -(-offset // _DIRECT_ALIGN) * _DIRECT_ALIGN  # first page boundary inside
        last = end // _DIRECT_ALIGN * _DIRECT_ALIGN  # last page boundary inside
        if last <= first:  # no whole page inside: at most one page boundary to split at
            split = min(first, end)
            self._keep_partial(fd, offset, view[: split - offset])
            self._keep_partial(fd, split, view[split - offset :])
            return
        if offset < first:
            self._keep_partial(fd, offset, view[: first - offset])
        if last < end:
            self._keep_partial(fd, last, view[last - offset :])
        self._write_pages(fd, first, view[first - offset : last - offset])

    def _write_pages(self, fd: int, offset: int, pages: memoryview) -> None:
        """Write whole pages at a page-aligned ``offset``: straight from ``pages`` when it is
        page-aligned in memory, else through this thread's bounce buffer."""
        address = _address(pages)
        if address is not None and address % _DIRECT_ALIGN == 0:
            self._pwrite_direct(fd, pages, offset)
            return
        local = _thread_pages()
        local.bounce = _aligned(local.bounce, min(len(pages), _BOUNCE_BYTES))
        bounce = memoryview(local.bounce)
        for start in range(0, len(pages), len(bounce)):
            piece = pages[start : start + len(bounce)]
            bounce[: len(piece)] = piece
            self._pwrite_direct(fd, bounce[: len(piece)], offset + start)

    def _pwrite_direct(self, fd: int, view: memoryview, offset: int) -> None:
        try:
            _pwrite_all(fd, view, offset)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            # The file system took the open but not this write (alignment it wants larger):
            # continue buffered; what went out directly is already in the file.
            self._fall_back_to_buffered(fd, f"an O_DIRECT write failed: {err}")
            _pwrite_all(fd, view, offset)

    def _fall_back_to_buffered(self, fd: int, reason: str) -> None:
        with self._lock:
            if self._direct:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
                self._direct = False
                self._store.refuse_direct(reason)

    def _keep_partial(self, fd: int, offset: int, piece: memoryview) -> None:
        """Collect ``piece``, which lies within one page; write the page once it is whole."""
        if not piece:
            return
        page_offset = offset - offset % _DIRECT_ALIGN
        start = offset - page_offset
        with self._lock:
            page = self._pages.get(page_offset)
            if page is None:
                page = self._pages[page_offset] = _PartialPage()
            page.data[start : start + len(piece)] = piece
            page.ranges.append((start, start + len(piece)))
            page.filled += len(piece)
            if page.filled < _DIRECT_ALIGN:
                return
            del self._pages[page_offset]
        self._write_pages(fd, page_offset, memoryview(page.data))

    def _flush_partial_pages(self, fd: int) -> None:
        """Write the pages still incomplete at commit: the last one, and any beside a hole."""
        with self._lock:
            pages, self._pages = self._pages, {}
        for page_offset, page in sorted(pages.items()):
            if self._direct:
                # Bytes never written read as zeros, as in a file written with pwrite; the
                # last page's tail beyond the extent is cut off by the truncate at commit.
                self._write_pages(fd, page_offset, memoryview(page.data))
            else:
                for start, stop in page.ranges:
                    _pwrite_all(fd, memoryview(page.data)[start:stop], page_offset + start)

    def commit(self, *, retain_for: float | None = None) -> str:
        if self._fd is None or self._done:
            raise StorageError("extent writer is closed")
        final = self._store.path_of(self._id)
        try:
            self._flush_partial_pages(self._fd)
            os.ftruncate(self._fd, self._size)  # whole pages may have run past the end
            if self._store.durable:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            new_shard = not final.parent.exists()
            final.parent.mkdir(mode=_PRIVATE_DIR, exist_ok=True)
            os.rename(self._temp, final)
            if self._store.durable:
                _fsync_dir(final.parent)
                if new_shard:  # the shard's own entry must be durable too
                    _fsync_dir(self._store.extent_dir)
        except OSError as err:
            self.abort()
            raise StorageError(f"committing extent failed: {err}") from err
        self._done = True
        return self._id

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
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


class _LocalReader(ExtentReader):
    def __init__(self, path: Path) -> None:
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ExtentNotFoundError(f"no extent at {path.name}") from None
        except OSError as err:
            raise StorageError(f"opening extent failed: {err}") from err
        self._size = os.fstat(self._fd).st_size

    @property
    def size(self) -> int:
        return self._size

    def readinto(self, offset: int, buffers: Sequence[Buffer]) -> None:
        if self._fd is None:
            raise StorageError("extent reader is closed")
        views = [memoryview(b).cast("B") for b in buffers]
        wanted = sum(len(v) for v in views)
        done = 0
        while done < wanted:
            # preadv may return short counts and takes at most IOV_MAX buffers a call; continue
            # with what is left.
            skip = done
            rest: list[memoryview] = []
            for view in views:
                if skip >= len(view):
                    skip -= len(view)
                    continue
                rest.append(view[skip:])
                skip = 0
            try:
                got = os.preadv(self._fd, rest[:_IOV_MAX], offset + done)
            except OSError as err:
                raise StorageError(f"reading extent failed: {err}") from err
            if got == 0:
                raise ShortReadError(
                    f"extent ended at byte {offset + done}, wanted up to {offset + wanted}"
                )
            done += got

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LocalBlockStore(BlockStore):
    """Extents as files under ``root``. ``durable=False`` skips fsync (tests, scratch caches).

    ``direct`` writes extents with ``O_DIRECT``, past the page cache (see :class:`_LocalWriter`);
    by default a durable store does, where the platform and file system allow it. A store does
    not then leave its extent in the page cache: the first load of it reads the device.

    Every directory is owner-only (0700) and every file 0600; opening a store whose directories
    group or others can reach fixes them, with a logged warning.
    """

    def __init__(
        self, root: str | os.PathLike[str], *, durable: bool = True, direct: bool | None = None
    ) -> None:
        self.root = Path(root)
        self.durable = durable
        #: Whether new extents are written with O_DIRECT (False once the file system refused).
        self.direct = bool(_O_DIRECT) and (durable if direct is None else direct)
        self.extent_dir = self.root / "extents"
        self.temp_dir = self.root / "tmp"
        for directory in (self.root, self.extent_dir, self.temp_dir):
            _private_dir(directory)
        for shard in self.extent_dir.iterdir():
            if shard.is_dir():
                _private_dir(shard)

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
        return _LocalReader(self.path_of(extent_id))

    def prefetch(self, extent_id: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Ask the kernel to read the ranges into the page cache (``POSIX_FADV_WILLNEED``)."""
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
