"""A namespace: one tenant's (optionally scoped) cache for one model fingerprint.

``store`` seals new full blocks into one layer-major extent and indexes them; ``lookup`` finds the
longest cached prefix; ``load`` streams a cached prefix layer by layer. Nothing is shared across
namespaces: each has its own hashing key, so identical tokens give unrelated block keys.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from sqlalchemy import Connection, delete, func, select
from sqlalchemy.exc import SQLAlchemyError

from .audit import QUOTA_REFUSED, SEGMENT_OPEN_FAILED
from .buffers import thread_buffer
from .crypto import ExtentCipher, SegmentContext, new_salt
from .errors import (
    CacheMissError,
    CacheUnavailableError,
    InvalidRequestError,
    LoadError,
    QuotaExceededError,
    SegmentIntegrityError,
    TenantNotFoundError,
)
from .extent_format import ExtentGeometry
from .health import LOST_EXTENTS
from .index.plan import ExtentRow, locate_blocks, record_use
from .index.schema import Block, DataKey, Extent, Tenant
from .layout import KVLayout
from .load_targets import LoadTarget
from .loader import ExtentFailure, LoadStream, open_readers
from .prefix import BLOCK_TOKENS, BlockKey, Fingerprint, block_keys
from .quota import Evicted, make_room
from .read_plan import PlannedExtent, ReadPlan, group_runs
from .retention import DEFAULT_KIND, check_kind
from .retention import loads as loads_retention
from .storage import ExtentWriter, StorageError
from .tokens import as_token_array

if TYPE_CHECKING:
    from .cache import TenantKV

logger = logging.getLogger("tenantkv")

# SQLite allows 32,766 bound parameters; stay far below it and below PostgreSQL's limits.
_QUERY_CHUNK = 500


@dataclass(frozen=True)
class NamespaceIdentity:
    namespace_id: bytes
    tenant_id: bytes
    tenant: str
    scope: str | None
    model: str
    fingerprint: Fingerprint


class Namespace:
    """Store, look up and load prefix caches of one (tenant, scope, model fingerprint)."""

    def __init__(
        self, kv: TenantKV, identity: NamespaceIdentity, layout: KVLayout, hash_key: bytes
    ) -> None:
        self._kv = kv
        self.identity = identity
        self.layout = layout
        self._hash_key = hash_key

    @property
    def tenant(self) -> str:
        return self.identity.tenant

    @property
    def scope(self) -> str | None:
        return self.identity.scope

    @property
    def model(self) -> str:
        return self.identity.model

    def __repr__(self) -> str:
        return (
            f"Namespace(tenant={self.tenant!r}, scope={self.scope!r}, model={self.model!r}, "
            f"layout={self.layout.kind})"
        )

    # ---- keys and index queries ---------------------------------------------------------------

    def _keys(self, tokens: Any) -> list[BlockKey]:
        return block_keys(self._hash_key, self.identity.fingerprint, as_token_array(tokens))

    def _present_keys(self, keys: Sequence[BlockKey], *, stop_at_gap: bool) -> set[bytes]:
        """The subset of ``keys`` that is indexed, queried in chunks.

        With ``stop_at_gap`` the query stops after the first chunk that misses a key, since
        nothing after a gap can extend the prefix.
        """
        found: set[bytes] = set()
        now = self._kv.clock()
        with self._kv.db.read() as session:
            for start in range(0, len(keys), _QUERY_CHUNK):
                chunk = list(keys[start : start + _QUERY_CHUNK])
                rows = session.scalars(
                    select(Block.block_key)
                    .join(Extent, Extent.id == Block.extent_id)
                    .where(
                        Block.namespace_id == self.identity.namespace_id,
                        Block.block_key.in_(chunk),
                        Extent.expires_at > now,  # expired blocks are misses before GC runs
                    )
                ).all()
                found.update(rows)
                if stop_at_gap and len(rows) < len(chunk):
                    break
        return found

    @staticmethod
    def _run_from_zero(keys: Sequence[BlockKey], present: set[bytes] | dict[bytes, Any]) -> int:
        count = 0
        for key in keys:
            if key not in present:
                break
            count += 1
        return count

    # ---- lookup -------------------------------------------------------------------------------

    def lookup(self, tokens: Any) -> int:
        """Length of the longest cached prefix of ``tokens`` (a multiple of 64; 0 on a miss).

        Index failures degrade to 0 (logged, counted, not metered) unless the cache was opened
        with ``strict=True``.
        """
        self._kv.check_open()
        token_array = as_token_array(tokens)
        keys = block_keys(self._hash_key, self.identity.fingerprint, token_array)
        hit = 0
        if keys:
            try:
                present = self._present_keys(keys, stop_at_gap=True)
            except SQLAlchemyError as err:
                # An index outage is the operator's, not a miss to bill to the tenant.
                return self._kv.serving.degrade("lookup", err, 0)
            hit = self._run_from_zero(keys, present) * BLOCK_TOKENS
        self._meter(hit_tokens=hit, miss_tokens=len(token_array) - hit)
        return hit

    def cached_length(self, tokens: Any) -> int:
        """Like :meth:`lookup`, but not metered: for a writer deciding what to pass to
        :meth:`store` (``start=``), not for answering requests. Failures degrade to 0."""
        self._kv.check_open()
        keys = self._keys(tokens)
        if not keys:
            return 0
        try:
            present = self._present_keys(keys, stop_at_gap=True)
        except SQLAlchemyError as err:
            return self._kv.serving.degrade("cached_length", err, 0)
        return self._run_from_zero(keys, present) * BLOCK_TOKENS

    # ---- store --------------------------------------------------------------------------------

    def store(
        self, tokens: Any, layers: Sequence[Any], *, kind: str = DEFAULT_KIND, start: int = 0
    ) -> int:
        """Store the full 64-token blocks of ``tokens`` that are not cached yet.

        ``layers`` holds one entry per model layer covering the tokens ``tokens[start:]``: a
        tensor ``[T - start, kv_lora_rank + rope_dim]`` (MLA) or a pair ``(k, v)`` of
        ``[T - start, heads, head_dim]`` (MHA). ``start`` (a multiple of 64, default 0) lets a
        caller that knows the first ``start`` tokens are cached (:meth:`cached_length`) pass
        only the rest, so a long conversation's next turn copies only its new tokens; blocks
        before ``start`` that turn out not to be cached are skipped (their keys are known,
        their KV is not), and a later store from 0 fills them. ``kind`` is the retention class
        (the tenant's, e.g. ``"agent"`` or ``"chat"``). Returns the number of tokens newly
        stored. Input is validated before anything is written; a storage or index failure
        stores nothing (and returns 0 unless strict). A store that would exceed the tenant's
        quota first evicts the tenant's least recently used extents; one that cannot fit
        raises QuotaExceededError.
        """
        self._kv.check_open()
        token_array = as_token_array(tokens)
        if (
            isinstance(start, bool)
            or not isinstance(start, int)
            or not 0 <= start <= len(token_array)
            or start % BLOCK_TOKENS
        ):
            raise InvalidRequestError(
                f"start must be a multiple of {BLOCK_TOKENS} within the {len(token_array)} "
                f"tokens, got {start!r}"
            )
        rows = self.layout.validate_layers(layers, len(token_array) - start)
        check_kind(kind)
        keys = block_keys(self._hash_key, self.identity.fingerprint, token_array)
        try:
            settings = self._tenant_settings()
            if kind not in settings[3]:
                raise InvalidRequestError(
                    f"unknown retention class {kind!r}; tenant {self.tenant!r} has "
                    f"{', '.join(sorted(settings[3]))}"
                )
            if not keys:
                return 0
            present = self._present_keys(keys, stop_at_gap=False)
            first_missing = max(self._run_from_zero(keys, present), start // BLOCK_TOKENS)
            positions = [i for i in range(first_missing, len(keys)) if keys[i] not in present]
            if not positions:
                return 0
            return self._store_blocks(keys, positions, rows, start // BLOCK_TOKENS, kind, settings)
        except (SQLAlchemyError, StorageError) as err:
            return self._kv.serving.degrade("store", err, 0)

    def _tenant_settings(self) -> tuple[int, bytes, int, dict[str, float]]:
        """(key version, data key, quota bytes, retention) of the tenant, now."""
        with self._kv.db.read() as session:
            row = session.execute(
                select(Tenant.current_key_version, Tenant.quota_bytes, Tenant.retention).where(
                    Tenant.id == self.identity.tenant_id
                )
            ).one_or_none()
            if row is None:
                raise TenantNotFoundError(f"tenant {self.tenant!r} no longer exists")
            version, quota, retention = row
            wrapped = session.scalar(
                select(DataKey.wrapped_key).where(
                    DataKey.tenant_id == self.identity.tenant_id, DataKey.version == version
                )
            )
        if wrapped is None:
            raise CacheUnavailableError(f"tenant {self.tenant!r} has no data key {version}")
        data_key = self._kv.keyring.data_key(self.identity.tenant_id, version, wrapped)
        return version, data_key, quota, loads_retention(retention)

    def _store_blocks(
        self,
        keys: list[BlockKey],
        positions: list[int],
        rows: list[torch.Tensor],
        first_row_block: int,
        kind: str,
        settings: tuple[int, bytes, int, dict[str, float]],
    ) -> int:
        key_version, data_key, quota, retention = settings
        suite = self._kv.suite
        geometry = ExtentGeometry(
            num_blocks=len(positions),
            num_layers=self.layout.num_layers,
            segment_bytes=BLOCK_TOKENS * self.layout.token_bytes,
            suite=suite,
        )
        if geometry.total_bytes > quota:
            self._kv.record_security_event(
                "quota_refused",
                self.tenant,
                f"store of {geometry.total_bytes} B > quota {quota} B",
                QUOTA_REFUSED,
            )
            raise QuotaExceededError(
                f"this store needs {geometry.total_bytes} bytes, more than tenant "
                f"{self.tenant!r}'s whole quota of {quota} bytes"
            )
        salt = new_salt()
        context = SegmentContext(self.identity.tenant_id, key_version, self.identity.namespace_id)
        cipher = ExtentCipher(data_key, salt, context, suite)
        extent_id = self._write_extent(geometry, cipher, keys, positions, rows, first_row_block)
        try:
            inserted, evicted = self._index_extent(
                extent_id, geometry, key_version, salt, keys, positions, kind, retention[kind]
            )
        except BaseException as err:
            self._kv.store_backend.delete(extent_id)
            if isinstance(err, QuotaExceededError):
                self._kv.record_security_event(
                    "quota_refused", self.tenant, str(err), QUOTA_REFUSED
                )
            raise
        if inserted == 0:
            self._kv.store_backend.delete(extent_id)  # another writer indexed these blocks first
        self._kv.discard_evicted(self.identity.tenant_id, evicted)
        if inserted:
            self._meter(stored_tokens=inserted * BLOCK_TOKENS, stored_bytes=geometry.total_bytes)
        return inserted * BLOCK_TOKENS

    def _seal_and_write_layer(
        self,
        writer: ExtentWriter,
        geometry: ExtentGeometry,
        cipher: ExtentCipher,
        layer: int,
        keys: list[BlockKey],
        positions: list[int],
        rows: torch.Tensor,
        first_row_block: int,
    ) -> None:
        """Worker: seal one layer's new segments into this thread's buffer and write them.

        ``rows`` starts at block ``first_row_block`` of the prefix (see ``store(start=)``).
        """
        sealed = geometry.sealed_bytes
        plain = geometry.segment_bytes
        out = thread_buffer(geometry.layer_stride)
        source = memoryview(rows.numpy()).cast("B")  # type: ignore[arg-type]
        for slot, position in enumerate(positions):
            row_block = position - first_row_block
            assert row_block >= 0, "a stored block lies before the rows the caller passed"
            cipher.seal_into(
                slot,
                layer,
                keys[position],
                source[row_block * plain : (row_block + 1) * plain],
                out[slot * sealed : (slot + 1) * sealed],
            )
        writer.write_at(geometry.offset(layer, 0), out)

    def _write_extent(
        self,
        geometry: ExtentGeometry,
        cipher: ExtentCipher,
        keys: list[BlockKey],
        positions: list[int],
        rows: list[torch.Tensor],
        first_row_block: int,
    ) -> str:
        """Seal and write layers on the worker pool, a bounded window at a time; then commit.

        Layers go to disjoint offsets, so workers write them in parallel (one ``pwrite`` each)
        and no layer waits for another; the window keeps a large store from queueing all its
        layers ahead of concurrent loads on the shared pool.
        """
        executor = self._kv.executor
        with self._kv.store_backend.create() as writer:
            writer.write_at(0, geometry.header())
            pending: set[Future[None]] = set()
            try:
                for layer in range(geometry.num_layers):
                    if len(pending) >= self._kv.window:
                        done, pending = wait_futures(pending, return_when=FIRST_COMPLETED)
                        for future in done:
                            future.result()
                    pending.add(
                        executor.submit(
                            self._seal_and_write_layer,
                            writer,
                            geometry,
                            cipher,
                            layer,
                            keys,
                            positions,
                            rows[layer],
                            first_row_block,
                        )
                    )
                for future in wait_futures(pending).done:
                    future.result()
            finally:
                for future in pending:
                    future.cancel()
                wait_futures(pending)  # no worker may still write once the writer is aborted
            return writer.commit()

    def _index_extent(
        self,
        extent_id: str,
        geometry: ExtentGeometry,
        key_version: int,
        salt: bytes,
        keys: list[BlockKey],
        positions: list[int],
        kind: str,
        ttl: float,
    ) -> tuple[int, list[Evicted]]:
        now = self._kv.clock()
        namespace_id = self.identity.namespace_id
        tenant_id = self.identity.tenant_id
        evicted: list[Evicted] = []
        with self._kv.db.write() as session:
            # Serialise quota accounting per tenant across processes (a no-op on SQLite, whose
            # write transactions are already exclusive).
            quota = session.scalar(
                select(Tenant.quota_bytes).where(Tenant.id == tenant_id).with_for_update()
            )
            if quota is None:
                raise TenantNotFoundError(f"tenant {self.tenant!r} no longer exists")
            session.add(
                Extent(
                    id=extent_id,
                    namespace_id=namespace_id,
                    tenant_id=tenant_id,
                    key_version=key_version,
                    kind=kind,
                    suite=int(geometry.suite),
                    salt=salt,
                    num_blocks=geometry.num_blocks,
                    num_layers=geometry.num_layers,
                    segment_bytes=geometry.segment_bytes,
                    size_bytes=geometry.total_bytes,
                    created_at=now,
                    last_used_at=now,
                    expires_at=now + ttl,
                )
            )
            session.flush()
            # Rows of these blocks left by an expired extent (not yet collected) would make the
            # insert skip them, so an expired prefix could not be stored again until GC.
            expired = select(Extent.id).where(
                Extent.namespace_id == namespace_id, Extent.expires_at <= now
            )
            for start in range(0, len(positions), _QUERY_CHUNK):
                chunk = [keys[p] for p in positions[start : start + _QUERY_CHUNK]]
                session.execute(
                    delete(Block).where(
                        Block.namespace_id == namespace_id,
                        Block.block_key.in_(chunk),
                        Block.extent_id.in_(expired),
                    )
                )
            session.execute(
                self._kv.db.insert_ignoring_duplicates(Block.__table__),
                [
                    {
                        "namespace_id": namespace_id,
                        "block_key": keys[position],
                        "extent_id": extent_id,
                        "slot": slot,
                        "position": position,
                        "stored_at": now,
                        "last_used_at": now,
                    }
                    for slot, position in enumerate(positions)
                ],
            )
            inserted = session.scalar(
                select(func.count()).select_from(Block).where(Block.extent_id == extent_id)
            )
            if not inserted:
                session.execute(delete(Extent).where(Extent.id == extent_id))
            else:
                evicted = make_room(
                    session, tenant_id, quota, now, lease_now=time.time(), keep=extent_id
                )
        return int(inserted or 0), evicted

    # ---- load ---------------------------------------------------------------------------------

    def load(
        self,
        tokens: Any,
        device: str | torch.device = "cpu",
        *,
        out: Sequence[Any] | None = None,
        block_rows: Sequence[int] | None = None,
    ) -> LoadStream:
        """Stream the cached prefix ``tokens`` (whole 64-token blocks, all cached) layer by layer.

        Reading starts at once, in the background; iterate the stream, or call
        ``wait_for_layer(i)``, to receive layers. Without ``out`` every layer is a fresh tensor of
        exactly ``len(tokens)`` rows on ``device``. With ``out`` (one buffer per layer: a tensor
        ``[R, kv_lora_rank + rope_dim]`` for MLA, a ``(k, v)`` pair of ``[R, heads, head_dim]``
        for MHA, contiguous, on ``device``) the layers are written in place and the stream yields
        those same buffers: rows ``0 .. len(tokens) - 1``, or, with ``block_rows``, rows
        ``block_rows[b] .. block_rows[b] + 63`` for block ``b`` (paged KV). Rows outside the loaded
        ones are left untouched.

        Raises :class:`CacheMissError` when any block is not cached, :class:`InvalidRequestError`
        for bad arguments, and :class:`SegmentIntegrityError` when an extent is found damaged
        before the first layer.
        """
        self._kv.check_open()
        target_device = self._parse_device(device)
        token_array = as_token_array(tokens)
        if len(token_array) == 0 or len(token_array) % BLOCK_TOKENS:
            raise InvalidRequestError(
                f"load takes a whole number of 64-token blocks (got {len(token_array)} tokens); "
                "use lookup() to find the cached length"
            )
        keys = block_keys(self._hash_key, self.identity.fingerprint, token_array)
        target = LoadTarget(
            self.layout, target_device, len(keys), out, block_rows, self._kv.layer_pool
        )
        try:
            plan, lease = self._plan_and_lease(keys)
        except SQLAlchemyError as err:
            raise self._kv.serving.load_unavailable(err) from err
        try:
            readers = open_readers(self._kv.store_backend, plan)
        except ExtentFailure as failure:
            self._kv.leases.release(lease)
            self._handle_failure(failure)
            if failure.lost:
                raise CacheMissError(
                    f"a cached extent's bytes are gone ({failure.cause}); the prefix was dropped"
                ) from failure.cause
            if not failure.integrity:
                raise LoadError(
                    f"reading a cached extent failed: {failure.cause}", delivered_layers=0
                ) from failure.cause
            raise SegmentIntegrityError(
                "a cached extent is damaged; the prefix was dropped", delivered_layers=0
            ) from failure.cause
        extent_ids = [extent.extent_id for extent in plan.extents]
        started = self._kv.clock()
        try:
            stream = LoadStream(
                plan=plan,
                layout=self.layout,
                readers=readers,
                target=target,
                pool=self._kv.load_executor,
                ring=self._kv.staging_ring(pinned=target.device.type == "cuda"),
                window=self._kv.window,
                workers=self._kv.workers,
                on_failure=self._handle_failure,
                # Record the use after the load, off its critical path (the index write would
                # otherwise compete for the interpreter with the first layer's workers).
                on_close=lambda stream: self._finish_load(stream, lease, extent_ids, started),
            )
        except BaseException:
            self._kv.leases.release(lease)
            for reader in readers.values():
                reader.close()
            raise
        self._kv.track_stream(stream)
        return stream

    def prefetch(self, tokens: Any) -> int:
        """Start reading the longest cached prefix of ``tokens`` into memory; return its length.

        Asks the block store to read the prefix's byte ranges ahead (the OS page cache for the
        local store) and returns at once, so a later ``load`` of the prefix finds its bytes in
        memory. Holds no buffers or threads of its own; a prefetch that is never followed by a
        load costs only the read. Failures degrade to 0.
        """
        self._kv.check_open()
        keys = self._keys(tokens)
        try:
            present = self._present_keys(keys, stop_at_gap=True)
            cached = self._run_from_zero(keys, present)
            if cached == 0:
                return 0
            with self._kv.db.read_connection() as connection:
                plan = self._plan(connection, keys[:cached])
            for run in plan.runs:
                geometry = run.extent.geometry
                ranges = [
                    (geometry.offset(layer, run.first_slot), run.count * geometry.sealed_bytes)
                    for layer in range(geometry.num_layers)
                ]
                self._kv.store_backend.prefetch(run.extent.extent_id, ranges)
        except (SQLAlchemyError, StorageError, CacheMissError) as err:
            return self._kv.serving.degrade("prefetch", err, 0)
        return cached * BLOCK_TOKENS

    @staticmethod
    def _parse_device(device: str | torch.device) -> torch.device:
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError):
            raise InvalidRequestError(f"unknown device {device!r}") from None
        if target.type not in ("cpu", "cuda"):
            raise InvalidRequestError(f"device {target} is not supported (use cpu or cuda)")
        if target.type == "cuda" and not torch.cuda.is_available():
            raise InvalidRequestError(f"device {target} is not available")
        return target

    def _plan_and_lease(self, keys: list[BlockKey]) -> tuple[ReadPlan, bytes]:
        """The read plan of ``keys`` and a lease on its extents, taken in one write
        transaction: an extent this plan names cannot lose its bytes before the lease holds."""
        lease: bytes | None = None
        try:
            with self._kv.db.write_connection() as connection:
                plan = self._plan(connection, keys)
                lease = self._kv.leases.acquire(connection, [e.extent_id for e in plan.extents])
        except BaseException:
            if lease is not None:  # the transaction that took it rolled back
                self._kv.leases.forget(lease)
            raise
        return plan, lease

    def _plan(self, connection: Connection, keys: list[BlockKey]) -> ReadPlan:
        """Where every block of ``keys`` lies, with the cipher of each extent; or CacheMissError.

        Every block must be indexed in this namespace with an unexpired extent, whose key
        version still exists and whose geometry matches this namespace's layout.
        """
        located: dict[bytes, tuple[str, int]] = {}
        extents: dict[str, ExtentRow] = {}
        identity = self.identity
        now = self._kv.clock()
        for start in range(0, len(keys), _QUERY_CHUNK):
            chunk = keys[start : start + _QUERY_CHUNK]
            found, rows = locate_blocks(
                connection,
                tenant_id=identity.tenant_id,
                namespace_id=identity.namespace_id,
                keys=chunk,
                now=now,
            )
            located.update(found)
            extents.update(rows)
            if len(found) < len(chunk):
                break
        cached = self._run_from_zero(keys, located)
        if cached < len(keys):
            raise CacheMissError(
                f"only {cached * BLOCK_TOKENS} of {len(keys) * BLOCK_TOKENS} tokens are cached"
            )
        planned = {extent_id: self._planned_extent(row) for extent_id, row in extents.items()}
        return group_runs([(key, planned[located[key][0]], located[key][1]) for key in keys])

    def _planned_extent(self, row: ExtentRow) -> PlannedExtent:
        """The geometry and cipher of one indexed extent, after checking it fits this namespace."""
        if row.wrapped_key is None:
            raise CacheMissError(f"data key version {row.key_version} is gone")
        geometry = ExtentGeometry(
            row.num_blocks, row.num_layers, row.segment_bytes, self._kv.suite_of(row.suite)
        )
        if geometry.num_layers != self.layout.num_layers or geometry.segment_bytes != (
            BLOCK_TOKENS * self.layout.token_bytes
        ):
            raise CacheMissError("an indexed extent does not match this namespace's layout")
        tenant_id = self.identity.tenant_id
        data_key = self._kv.keyring.data_key(tenant_id, row.key_version, row.wrapped_key)
        context = SegmentContext(tenant_id, row.key_version, self.identity.namespace_id)
        cipher = ExtentCipher(data_key, row.salt, context, geometry.suite)
        return PlannedExtent(row.extent_id, geometry, cipher)

    def _finish_load(
        self, stream: LoadStream, lease: bytes, extent_ids: list[str], started: float
    ) -> None:
        """After a load: meter it; in the background, record the use and end the lease."""
        if stream.delivered_layers == stream.num_layers:
            self._meter(served_tokens=stream.num_tokens)
        self._kv.submit_background(self._touch, lease, extent_ids, started)

    def _touch(self, lease: bytes, extent_ids: list[str], now: float) -> None:
        """Mark extents as used at ``now`` (their retention restarts and LRU eviction sees
        the use) and end the load's lease, in one transaction; then remove the bytes of any
        extent that left the index while the lease kept them. Bookkeeping only: never fails a
        load (a lease that cannot be released lapses)."""
        try:
            with self._kv.db.write_connection() as connection:
                record_use(connection, self.identity.tenant_id, extent_ids, now)
                self._kv.leases.release(lease, connection)
        except SQLAlchemyError as err:
            logger.warning("could not record extent use or end a lease: %s", err)
            self._kv.leases.release(lease)
            return
        self._kv.leases.remove_unindexed(extent_ids)

    def _meter(self, **counts: int) -> None:
        self._kv.meter.add(self.identity.tenant_id, self.scope or "", self._kv.clock(), **counts)

    # ---- failures -----------------------------------------------------------------------------

    def _handle_failure(self, failure: ExtentFailure) -> None:
        """Integrity: drop the extent and record a security event. Lost: drop it from the index
        and count it. I/O: log it (the bytes may well be intact)."""
        if failure.integrity:
            self._kv.record_security_event(
                "segment_open_failed",
                self.tenant,
                f"extent {failure.extent_id} layer {failure.layer}: {failure.cause}",
                SEGMENT_OPEN_FAILED,
            )
            self._kv.drop_extent(failure.extent_id)
        elif failure.lost:
            # Not evidence of an attack (a shared tier evicted it, a disk lost it): the index
            # forgets it, so later lookups miss, and operators see a counter.
            logger.warning("extent %s is lost: %s", failure.extent_id, failure.cause)
            self._kv.health.count(LOST_EXTENTS)
            self._kv.drop_extent(failure.extent_id)
        else:
            logger.warning("reading extent %s failed: %s", failure.extent_id, failure.cause)

    def cached_blocks(self) -> Iterator[int]:
        """Positions of this namespace's cached blocks (for checks and tests; no token data)."""
        with self._kv.db.read() as session:
            yield from session.scalars(
                select(Block.position).where(Block.namespace_id == self.identity.namespace_id)
            ).all()
