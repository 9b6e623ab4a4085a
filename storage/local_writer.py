"""The writer of one local extent file (:class:`LocalWriter`): ``O_DIRECT`` writes of whole
pages from page-aligned memory, the pieces of partly covered pages at commit, blocks reserved up
front, and the commit by fsync and rename into ``extents/`` (the layout is ``local.py``'s).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import sys
import threading
from pathlib import Path
from typing import Any, Protocol

from typing_extensions import Buffer

from .base import ExtentWriter
from .directories import PRIVATE_DIR, fsync_dir
from .errors import StorageError
from .recent_owners import OwnerRings
from .recent_writes import Reservation, file_identity

# O_DIRECT moves whole pages from page-aligned memory at page-aligned offsets; 4 KiB covers
# devices with 512-byte and 4 KiB logical blocks.
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
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


class WriterStore(Protocol):
    """What a :class:`LocalWriter` needs of its store (``local.py``'s ``LocalBlockStore``),
    named here so that this module need not import the store's, which imports this one."""

    durable: bool
    direct: bool
    recent: OwnerRings | None
    extent_dir: Path
    temp_dir: Path

    def refuse_direct(self, reason: str) -> None: ...

    def path_of(self, extent_id: str) -> Path: ...


class LocalWriter(ExtentWriter):
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

    def __init__(self, store: WriterStore, extent_id: str, owner: str = "") -> None:
        """``owner``: whose ring of recent writes keeps the extent (``recent_owners.py``)."""
        self._store = store
        self._id = extent_id
        self._owner = owner
        self._temp = store.temp_dir / f"{self._id}.part"
        self._fd: int | None = os.open(
            self._temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
        )
        self._direct_fd: int | None = None  # open until commit or abort
        if store.direct:
            try:
                self._direct_fd = os.open(self._temp, os.O_WRONLY | os.O_CLOEXEC | O_DIRECT)
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
            self._ring = ring.reserve(self._id, size, self._owner)
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
