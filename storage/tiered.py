"""A hot tier (Redis, Valkey) in front of a cold, durable tier (a shared POSIX directory).

Write policy -- **write-through, hot tier best effort**: a new extent is written to every tier at
once (each ``write_at`` goes to each tier's writer), and :meth:`commit` publishes it in the
coldest tier first, then in the hotter ones. Why:

* the cold tier is the extent's only durable home, so a commit succeeds exactly when the cold
  commit does; a hot-tier failure at any point only drops the hot copy (counted in
  :meth:`TieredBlockStore.stats`), the store still succeeds;
* a hot copy never appears before the cold one, so whatever a reader finds hot, the cold tier
  also has (until a delete, which removes hot copies first);
* prefixes are most often reused soon after they are stored (the next turn of a chat, the
  next call of an agent), so writing them hot at once saves the first read's trip to the cold
  tier, at the price of sending every stored byte over the network once more. Write-back (hot
  first, cold later) would make a Redis eviction or restart lose extents; write-around (cold
  only, promote on read) makes every first reuse cold.

Reads are read-through: :meth:`open` tries the tiers hottest first; a miss or a failure in a hot
tier reads the cold tier instead and promotes the extent into the hot tiers in the background
(one copy per extent at a time). A reader whose hot copy vanishes or fails mid-read (eviction,
``CLIENT KILL``, a Redis restart) finishes from the cold tier: a hot-tier outage costs speed,
never a load the cold tier can serve. :meth:`prefetch` promotes too. After a hot tier fails,
it is left out of reads, writes and promotions for ``hot_retry_s`` seconds (counted as
``skipped``), so an unreachable server costs one timeout per interval, not one per call.

Capabilities (durability, listing, eviction) are the cold tier's: the hot tier is a cache of
it, and its evictions are hot misses, not lost extents.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from typing_extensions import Buffer

from .base import BlockStore, ExtentReader, ExtentWriter, StoreCapabilities
from .errors import ExtentNotFoundError, StorageError

logger = logging.getLogger("tenantkv.storage")

#: Bytes a promotion copies per read/write.
PROMOTE_CHUNK = 8 * 2**20


class _TierCounters:
    """Per-tier event counts, thread-safe."""

    def __init__(self, tiers: int) -> None:
        self._lock = threading.Lock()
        self._counts = [Counter[str]() for _ in range(tiers)]

    def count(self, tier: int, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[tier][name] += amount

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {f"tier{i}": dict(c) for i, c in enumerate(self._counts)}


class _TieredWriter(ExtentWriter):
    """The cold tier's writer (authoritative) plus best-effort writers of the hot tiers."""

    def __init__(self, store: TieredBlockStore, owner: str = "") -> None:
        self._store = store
        # One random id for every tier, chosen here as a store's create() would.
        self.extent_id = secrets.token_hex(16)
        self._cold = store.tiers[-1].create_as(self.extent_id, owner)
        self._hot: dict[int, ExtentWriter] = {}
        self._lock = threading.Lock()
        for tier in range(len(store.tiers) - 1):
            if not store.usable(tier):
                continue
            try:
                self._hot[tier] = store.tiers[tier].create_as(self.extent_id, owner)
            except StorageError as err:
                store.hot_failure(tier, "write_errors", err)

    def _drop_hot(self, tier: int, err: BaseException) -> None:
        with self._lock:
            writer = self._hot.pop(tier, None)
        if writer is not None:
            writer.abort()
            self._store.hot_failure(tier, "write_errors", err)

    def _hot_writers(self) -> list[tuple[int, ExtentWriter]]:
        with self._lock:
            return list(self._hot.items())

    def _to_hot(
        self, call: Callable[[ExtentWriter], object], *, coldest_first: bool = False
    ) -> None:
        """``call`` on every hot tier's writer, best effort: a tier whose call fails is dropped
        from this extent."""
        writers = self._hot_writers()
        for tier, writer in reversed(writers) if coldest_first else writers:
            try:
                call(writer)
            except StorageError as err:
                self._drop_hot(tier, err)

    def reserve(self, size: int) -> None:
        # Every tier's: a local hot tier allocates the file's blocks and a place in its ring
        # of recent writes too (its loads then read memory, as the cold tier's would).
        self._cold.reserve(size)
        self._to_hot(lambda writer: writer.reserve(size))

    def scratch(self, offset: int, size: int) -> memoryview:
        # The cold tier's memory: a local cold tier writes it with O_DIRECT without a copy.
        return self._cold.scratch(offset, size)

    def write(self, data: Buffer) -> None:
        self._cold.write(data)
        self._to_hot(lambda writer: writer.write(data))

    def write_at(self, offset: int, data: Buffer) -> None:
        self._cold.write_at(offset, data)
        self._to_hot(lambda writer: writer.write_at(offset, data))

    def commit(self, *, retain_for: float | None = None) -> str:
        try:
            extent_id = self._cold.commit(retain_for=retain_for)
        except BaseException:
            self.abort()
            raise
        self._to_hot(lambda writer: writer.commit(retain_for=retain_for), coldest_first=True)
        return extent_id

    def abort(self) -> None:
        self._cold.abort()
        for _, writer in self._hot_writers():
            writer.abort()


class _TieredReader(ExtentReader):
    """Reads one tier's copy; if a hot copy fails mid-read, continues from the cold tier."""

    def __init__(
        self, store: TieredBlockStore, extent_id: str, tier: int, reader: ExtentReader
    ) -> None:
        self._store = store
        self._id = extent_id
        self._tier = tier
        self._reader: ExtentReader | None = reader
        self._size = reader.size

    @property
    def size(self) -> int:
        return self._size

    def readinto(self, offset: int, buffers: Sequence[Buffer]) -> None:
        reader = self._reader
        if reader is None:
            raise StorageError("extent reader is closed")
        cold = len(self._store.tiers) - 1
        if self._tier == cold:
            reader.readinto(offset, buffers)
            return
        try:
            reader.readinto(offset, buffers)
            return
        except StorageError as err:
            if offset + sum(memoryview(b).nbytes for b in buffers) > self._size:
                raise  # a read past the end fails in every tier
            self._store.hot_failure(self._tier, "read_fallbacks", err)
        reader.close()
        self._reader = self._store.tiers[cold].open(self._id)
        self._tier = cold
        self._reader.readinto(offset, buffers)

    def mapped(self, segment_bytes: int = 0) -> memoryview | None:
        """The current tier's mapping, when it has one (a local file tier)."""
        return self._reader.mapped(segment_bytes) if self._reader is not None else None

    def done_with(self, offset: int, length: int) -> None:
        if self._reader is not None:
            self._reader.done_with(offset, length)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


class TieredBlockStore(BlockStore):
    """``tiers`` hottest first; the last is the durable tier every extent lives in.

    Every hot tier must support :meth:`BlockStore.create_as`. See the module docstring for the
    write policy and what a hot-tier outage does.
    """

    def __init__(
        self, tiers: Sequence[BlockStore], *, promote_workers: int = 2, hot_retry_s: float = 1.0
    ) -> None:
        if len(tiers) < 2:
            raise ValueError("a tiered store needs at least two tiers")
        self.tiers = list(tiers)
        self.hot_retry_s = hot_retry_s
        self._down_until = [0.0] * len(self.tiers)
        self._counters = _TierCounters(len(self.tiers))
        self._promoting: set[str] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(promote_workers, thread_name_prefix="tenantkv-promote")

    @property
    def capabilities(self) -> StoreCapabilities:
        cold = self.tiers[-1].capabilities
        hot_expires = any(t.capabilities.expires for t in self.tiers[:-1])
        return StoreCapabilities(
            durable=cold.durable,
            evicts_on_its_own=cold.evicts_on_its_own,
            cheap_listing=cold.cheap_listing,
            expires=cold.expires or hot_expires,
        )

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier (``tier0`` hottest): ``hits`` (opens it served), ``misses``, ``errors``
        (failures it was passed over for), ``skipped`` (calls that left it out while it was
        down), ``read_fallbacks`` (reads finished by the cold tier), ``write_errors``,
        ``promotions``."""
        return self._counters.snapshot()

    def usable(self, tier: int) -> bool:
        """Whether hot tier ``tier`` is to be tried (not within ``hot_retry_s`` of a failure)."""
        if self._down_until[tier] <= time.monotonic():
            return True
        self._counters.count(tier, "skipped")
        return False

    def hot_failure(self, tier: int, name: str, err: BaseException) -> None:
        self._down_until[tier] = time.monotonic() + self.hot_retry_s
        self._counters.count(tier, name)
        logger.warning("block-store tier %d failed (%s), using the cold tier: %s", tier, name, err)

    def create(self, owner: str = "") -> ExtentWriter:
        return _TieredWriter(self, owner)

    def create_as(self, extent_id: str, owner: str = "") -> ExtentWriter:
        raise StorageError("a tiered store cannot be a tier of another tiered store")

    def open(self, extent_id: str) -> ExtentReader:
        cold = len(self.tiers) - 1
        for tier, store in enumerate(self.tiers):
            if tier != cold and not self.usable(tier):
                continue
            try:
                reader = store.open(extent_id)
            except ExtentNotFoundError:
                if tier == cold:
                    raise
                self._counters.count(tier, "misses")
                continue
            except StorageError as err:
                if tier == cold:
                    raise
                self.hot_failure(tier, "errors", err)
                continue
            self._counters.count(tier, "hits")
            if tier > 0:
                self._promote_later(extent_id, tier)
            return _TieredReader(self, extent_id, tier, reader)
        raise AssertionError("unreachable: the cold tier either opens or raises")

    def prefetch(self, extent_id: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Promote the extent into the hot tiers (in the background) and pass the hint on."""
        self._promote_later(extent_id, len(self.tiers) - 1)
        for store in self.tiers:
            with contextlib.suppress(StorageError):  # advisory
                store.prefetch(extent_id, ranges)

    def _promote_later(self, extent_id: str, found_in: int) -> None:
        with self._lock:
            if extent_id in self._promoting:
                return
            self._promoting.add(extent_id)
        try:
            self._pool.submit(self._promote, extent_id, found_in)
        except RuntimeError:  # closed
            with self._lock:
                self._promoting.discard(extent_id)

    def _promote(self, extent_id: str, found_in: int) -> None:
        """Copy the extent from tier ``found_in`` into every hotter tier that lacks it."""
        try:
            for tier in range(found_in):
                self._copy(extent_id, found_in, tier)
        finally:
            with self._lock:
                self._promoting.discard(extent_id)

    def _copy(self, extent_id: str, source: int, target: int) -> None:
        if not self.usable(target):
            return
        hot = self.tiers[target]
        try:
            with hot.open(extent_id):
                return  # already there
        except ExtentNotFoundError:
            pass
        except StorageError as err:
            self.hot_failure(target, "errors", err)
            return
        try:
            with self.tiers[source].open(extent_id) as reader, hot.create_as(extent_id) as writer:
                buffer = bytearray(min(PROMOTE_CHUNK, reader.size))
                view = memoryview(buffer)
                for offset in range(0, reader.size, PROMOTE_CHUNK):
                    part = view[: min(PROMOTE_CHUNK, reader.size - offset)]
                    reader.readinto(offset, [part])
                    writer.write_at(offset, part)
                if reader.size == 0:
                    writer.write(b"")
                writer.commit()
        except ExtentNotFoundError:
            return  # deleted meanwhile
        except StorageError as err:
            self.hot_failure(target, "write_errors", err)
            return
        try:
            self.tiers[-1].modified_at(extent_id)
        except ExtentNotFoundError:  # deleted while it was copied: take the copy back
            hot.delete(extent_id)
            return
        except StorageError:
            pass
        self._counters.count(target, "promotions")

    def delete(self, extent_id: str) -> bool:
        """Hot copies first, so that no hot copy outlives the cold one for long."""
        for tier, store in enumerate(self.tiers[:-1]):
            try:
                store.delete(extent_id)
            except StorageError as err:  # a hot copy left behind expires with its TTL
                self.hot_failure(tier, "errors", err)
        return self.tiers[-1].delete(extent_id)

    def list(self) -> Iterator[str]:
        """The cold tier's extents: every extent lives there."""
        return self.tiers[-1].list()

    def modified_at(self, extent_id: str) -> float:
        return self.tiers[-1].modified_at(extent_id)

    def retain(self, extent_ids: Iterable[str], seconds: float) -> None:
        ids = list(extent_ids)
        for tier, store in enumerate(self.tiers):
            try:
                store.retain(ids, seconds)
            except StorageError as err:
                self.hot_failure(tier, "errors", err)

    def sweep_temporary(self, older_than: float | None = None) -> int:
        return sum(store.sweep_temporary(older_than) for store in self.tiers)

    def wait_for_promotions(self) -> None:
        """Block until the promotions started so far have finished (tests, benchmarks)."""
        self._pool.submit(lambda: None).result()
        while True:
            with self._lock:
                if not self._promoting:
                    return
            threading.Event().wait(0.005)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for store in self.tiers:
            store.close()
