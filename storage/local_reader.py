"""The reader of one local extent file (:class:`LocalReader`): ``preadv`` into the caller's
buffers, or spans of a read-only mapping of the file, and when a store's reads map
(:data:`MAPPED_SEGMENT_BYTES`, :func:`file_system_type`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from typing_extensions import Buffer

from .base import ExtentReader, copy_from_view
from .errors import ExtentNotFoundError, ShortReadError, StorageError

_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024

logger = logging.getLogger("tenantkv.storage")

_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
_PROBE_BYTES = 4 * 4096 + 1  # at least five pages, whatever the alignment
#: Reads that end within this many bytes of the start (the header check at open) start no
#: read-ahead: an open that only checks the header reads nothing more.
HEADER_READ = 4096


def _in_page_cache(fd: int, size: int) -> bool:
    """Whether three spans of the file (a quarter, half and three quarters in) are in the page
    cache: reads that stop rather than wait for the device (``RWF_NOWAIT``). True where that
    cannot be told.

    Lazily mapped extents are mapped only then: a fault on a page that is not cached reads
    the device a little at a time, and cold loads out of a mapping ran 25% slower than
    ``preadv``'s large reads (docs/perf.md). Each span covers several pages, since the edges
    of an ``O_DIRECT`` writer's regions are written through the page cache: a single byte
    there reads as cached while the pages around it are on the device only."""
    if size <= 0:
        return False
    if _RWF_NOWAIT is None:
        return True
    probe = bytearray(_PROBE_BYTES)
    for offset in (size // 4, size // 2, 3 * size // 4):
        length = min(_PROBE_BYTES, size - offset)
        try:
            if os.preadv(fd, [memoryview(probe)[:length]], offset, _RWF_NOWAIT) != length:
                return False
        except BlockingIOError:
            return False
        except OSError:  # the file system does not take RWF_NOWAIT
            return True
    return True


#: How far ahead of a cold read (one whose extent was not in the page cache at open) the reader
#: asks the kernel for the bytes that follow (``POSIX_FADV_WILLNEED``), and the step it moves
#: that window by. A load reads an extent layer after layer, front to back; between its reads
#: it decrypts, and without advice the device then idles where the kernel's own readahead covers
#: a few hundred KiB (a device's usual ``read_ahead_kb`` is 128). Advised ahead, the device
#: keeps a deep queue of large requests while the loader decrypts what came in (docs/perf.md,
#: "Cold loads"); where the kernel reads ahead a step by itself, it is not advised
#: (:func:`needs_read_ahead_advice`).
READ_AHEAD_BYTES = 64 << 20
READ_AHEAD_STEP = 16 << 20


@functools.lru_cache(maxsize=64)
def device_read_ahead_bytes(device: int) -> int | None:
    """The kernel's read-ahead window for files of the file system on ``device`` (an
    ``st_dev``): its backing device's ``read_ahead_kb``, in bytes; None where it cannot be told
    (no sysfs, a file system without a block device of its own)."""
    major, minor = os.major(device), os.minor(device)
    for path in (
        f"/sys/class/bdi/{major}:{minor}/read_ahead_kb",  # a whole disk, a device mapper volume
        f"/sys/dev/block/{major}:{minor}/../queue/read_ahead_kb",  # a partition: its disk's
    ):
        try:
            with open(path, encoding="ascii") as file:
                return int(file.read().strip()) * 1024
        except (OSError, ValueError):
            continue
    return None


def needs_read_ahead_advice(device_read_ahead: int | None) -> bool:
    """Whether a cold reader advises the kernel ahead of its reads (:data:`READ_AHEAD_BYTES`).

    Only where the kernel's own read-ahead falls short of a step: ``POSIX_FADV_SEQUENTIAL``
    doubles the device's window, and the kernel then keeps that much in flight ahead of the
    reads by itself. Advice has a cost of its own: ``POSIX_FADV_WILLNEED`` fills the page cache
    in single pages where the kernel's read-ahead uses large folios, and every later warm read
    of those bytes pays for it (single-thread ``preadv`` of a 576 MB file 5.8 against 8.3 GB/s;
    on a disk reading 8 MiB ahead, an 8K-token load cold 1.39 GB/s with advice against 1.73
    without, and warm afterwards 4.56 against 4.84: ``bench/cold_read_ahead.py``, docs/perf.md,
    "Whole layers per worker, and the kernel's read-ahead where it reaches a step"). Where the
    window is unknown, advise.
    """
    return device_read_ahead is None or 2 * device_read_ahead < READ_AHEAD_STEP


class LocalReader(ExtentReader):
    """One extent file, mapped read-only when the store allows it (see :meth:`mapped`), else
    read with ``preadv``.

    ``map_from``: the smallest segment size the reader maps for (0: any, mapped at open; None:
    never). Above 0 the file is mapped on the first :meth:`mapped` call that asks for segments
    that large, and the descriptor stays open beside the mapping: another thread may be in
    :meth:`readinto` with it."""

    def __init__(self, path: Path, *, map_from: int | None) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ExtentNotFoundError(f"no extent at {path.name}") from None
        except OSError as err:
            raise StorageError(f"opening extent failed: {err}") from err
        self._fd: int | None = fd
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._map_from = map_from
        self._mapping = threading.Lock()  # one lazy mapping per reader
        #: Where read-ahead advice reaches (0: none given yet; None: no advice, the extent is
        #: read warm or the kernel reads ahead far enough by itself).
        self._advised: int | None = None
        self._cold = False
        try:
            stat = os.fstat(fd)
            self._size = stat.st_size
            self._device = stat.st_dev  # whose read-ahead window a cold read follows
            if map_from == 0 and self._size > 0:
                self._map_file(fd, keep_fd=False)
        except BaseException:
            self.close()
            raise

    def _map_file(self, fd: int, *, keep_fd: bool) -> None:
        """Map the file (``MAP_SHARED``, read-only: the page cache's own pages) and, unless
        ``keep_fd``, close our descriptor, since the mapping holds one of its own; a failed
        mapping leaves the reader reading with ``preadv``."""
        try:
            file_map = mmap.mmap(fd, self._size, prot=mmap.PROT_READ)
        except (OSError, ValueError) as err:
            logger.debug("mapping an extent failed (%s); reading it instead", err)
            self._map_from = None
            return
        with contextlib.suppress(OSError, AttributeError):  # advisory
            file_map.madvise(mmap.MADV_HUGEPAGE)
        self._map = file_map
        self._view = memoryview(file_map)
        if not keep_fd:
            os.close(fd)
            self._fd = None

    @property
    def size(self) -> int:
        return self._size

    def readinto(self, offset: int, buffers: Sequence[Buffer]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        if self._view is not None:
            copy_from_view(self._view, offset, views)
            return
        if self._fd is None:
            raise StorageError("extent reader is closed")
        wanted = sum(len(v) for v in views)
        if self._advised is not None and offset + wanted > HEADER_READ:
            self._read_ahead(offset, offset + wanted)
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

    def cold(self) -> bool:
        """Whether the extent was not in the page cache when the reader opened it: it is then
        read sequentially, with advice ahead of its reads where the kernel's own read-ahead
        falls short (:func:`needs_read_ahead_advice`)."""
        return self._cold

    @property
    def advises_read_ahead(self) -> bool:
        """Whether its reads advise the kernel ahead of them (``POSIX_FADV_WILLNEED``)."""
        return self._advised is not None

    def start_cold(self) -> None:
        """Called once at open by the store: a reader of an extent the page cache does not
        hold reads it sequentially, with advice ahead of its reads where needed."""
        fd = self._fd
        if fd is None or self._view is not None or _in_page_cache(fd, self._size):
            return
        self._cold = True
        with contextlib.suppress(OSError):  # advisory: doubles the kernel's own readahead
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        if needs_read_ahead_advice(device_read_ahead_bytes(self._device)):
            self._advised = 0

    def _read_ahead(self, offset: int, end: int) -> None:
        """Before a read of ``offset`` to ``end``: advise the kernel to read what is not yet
        advised of it and up to :data:`READ_AHEAD_BYTES` past it, in steps of
        :data:`READ_AHEAD_STEP`, front to back, so the device gets the read's own bytes first
        (several loader threads may call it at once: advice given twice is harmless, and a
        step missed is given by the next read)."""
        advised = self._advised or 0
        if end + READ_AHEAD_BYTES - READ_AHEAD_STEP < advised or advised >= self._size:
            return
        start = max(advised, offset)
        stop = min(self._size, end + READ_AHEAD_BYTES)
        self._advised = stop
        fd = self._fd
        if fd is None or stop <= start:
            return
        with contextlib.suppress(OSError):  # advisory only
            os.posix_fadvise(fd, start, stop - start, os.POSIX_FADV_WILLNEED)

    def mapped(self, segment_bytes: int = 0) -> memoryview | None:
        """The extent's mapping, when the store maps reads of segments this large
        (``map_reads``, :attr:`LocalBlockStore.mapped_segment_bytes`).

        Only on file systems where a mapped page cannot vanish: touching a mapped page of a
        file that was truncated, or that a network file system lost, raises SIGBUS and kills
        the process. Extents are never truncated: written once, renamed into place, and
        unlinked when deleted (an unlinked file stays readable while mapped).
        """
        if self._view is None and self._map_from is not None and segment_bytes >= self._map_from:
            with self._mapping:
                fd = self._fd
                if self._view is None and fd is not None and _in_page_cache(fd, self._size):
                    self._map_file(fd, keep_fd=True)
        return self._view

    def done_with(self, offset: int, length: int) -> None:
        """Unmap consumed pages from this process (``MADV_DONTNEED`` of a shared file mapping
        drops only the process's page-table entries; the page cache keeps the bytes, and a
        later touch maps them again)."""
        file_map = self._map
        if file_map is None or length <= 0:
            return
        start = offset - offset % mmap.PAGESIZE
        end = min(offset + length, self._size)
        with contextlib.suppress(OSError, ValueError):  # advisory; a closed map is skipped
            file_map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        view, file_map = self._view, self._map
        self._view = self._map = None
        if view is not None:
            view.release()
        if file_map is not None:
            # A slice still referenced somewhere (an exception's traceback) keeps the mapping
            # until it is collected.
            with contextlib.suppress(BufferError):
                file_map.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


#: File systems whose mapped pages cannot vanish under a reader: local disks and memory.
#: Network and FUSE file systems (NFS, CephFS, 3FS, ...) are read with ``preadv`` instead,
#: since a page they lose raises SIGBUS in whoever touches its mapping.
MAPPABLE_FILE_SYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "bcachefs", "tmpfs", "ramfs", "overlay"}
)


#: Where extents are written with ``O_DIRECT`` and ``map_reads`` is left to its default, loads
#: open segments at least this large straight out of a mapping (once the extent is in the
#: page cache) and read smaller ones with ``preadv``. Decrypting out of the mapping saves the
#: read's copy into a staging slot. The first measurements (issue 16) found 72 KiB segments (64
#: tokens of an MLA layer) slower mapped (8K-token loads 4.1 against 4.8 GB/s) and 144 KiB on
#: faster, so the bound was 128 KiB; since whole layers per worker and cold reads without
#: ``WILLNEED`` where the device reads ahead by itself, 72 KiB segments read faster mapped
#: whichever way their pages came in (8K tokens, warm: 7.1-8.3 against 6.5-6.8 GB/s; vLLM's MHA
#: blocks of 32 tokens are 64 KiB): docs/perf.md, "A faster Xeon VM". Not on every host: on an
#: AMD EPYC VM the same segments read at 0.71-0.74x staged mapped, and 288 KiB ones at 0.85x
#: (docs/perf.md, "Mapped segments on an AMD EPYC VM"); ``map_reads=False`` stages every read.
MAPPED_SEGMENT_BYTES = 64 * 1024


def file_system_type(path: Path) -> str | None:
    """The type of the file system holding ``path`` (from ``/proc/self/mountinfo``), or
    ``None`` when it cannot be told (not Linux, unreadable)."""
    try:
        target = os.path.realpath(path)
        with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
            lines = mounts.read().splitlines()
    except OSError:
        return None
    best, best_type = "", None
    for line in lines:
        fields = line.split()
        try:
            separator = fields.index("-")
        except ValueError:
            continue
        mount_point = fields[4].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best) and separator + 1 < len(fields):
            best, best_type = mount_point, fields[separator + 1]
    return best_type
