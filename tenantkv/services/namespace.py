"""A namespace: one tenant's (optionally scoped) cache for one model fingerprint.

``store`` seals new full blocks into one layer-major extent and indexes them; ``lookup`` finds the
longest cached prefix; ``load`` streams a cached prefix layer by layer. Nothing is shared across
namespaces: each has its own hashing key, so identical tokens give unrelated block keys.
"""

from __future__ import annotations

import logging
import secrets
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from ..audit import QUOTA_REFUSED, SEGMENT_OPEN_FAILED
from ..components.context import CacheContext
from ..components.health import LOST_EXTENTS
from ..components.key_guard import KeyGuard
from ..crypto import CipherSuite, ExtentCipher, SegmentContext, new_salt
from ..datapath.extent_format import ExtentGeometry
from ..datapath.first_layers import FirstLayerHold
from ..datapath.load_targets import LoadTarget
from ..datapath.loader import ExtentFailure, LoadStream, open_readers
from ..datapath.read_plan import PlannedExtent, ReadPlan, group_runs
from ..editing.lineage import EditedPrefix
from ..editing.script import EditScript
from ..errors import (
    CacheMissError,
    CacheUnavailableError,
    InvalidRequestError,
    LoadError,
    QuotaExceededError,
    SegmentIntegrityError,
    TenantNotFoundError,
)
from ..index import blocks, namespaces, removals
from ..index.plan import ExtentRow, locate_blocks
from ..index.quota import Evicted, make_room
from ..index.schema import Extent
from ..index.schema import Namespace as NamespaceRow
from ..layout import KVLayout
from ..prefix import (
    BLOCK_TOKENS,
    BLOCK_TOKENS_STEP,
    MAX_BLOCK_TOKENS,
    BlockKey,
    EditSeed,
    Fingerprint,
    block_keys,
    edit_binding,
    edit_seed,
    layout_identity,
    model_fingerprint,
)
from ..retention import DEFAULT_KIND, check_kind
from ..retention import loads as loads_retention
from ..storage import ExtentWriter, StorageError
from ..tokens import as_token_array
from .evictions import discard_evicted
from .tenants import check_tenant_name

logger = logging.getLogger("tenantkv")

#: The most sealed bytes one store task seals and writes at once (see ``_write_extent``).
STORE_PIECE_BYTES = 8 << 20


@dataclass(frozen=True)
class NamespaceIdentity:
    namespace_id: bytes
    tenant_id: bytes
    tenant: str
    scope: str | None
    model: str
    fingerprint: Fingerprint
    #: Tokens per block: every key, lookup length and load of the namespace is in these blocks.
    block_tokens: int = BLOCK_TOKENS


class Namespace:
    """Store, look up and load prefix caches of one (tenant, scope, model fingerprint)."""

    def __init__(
        self, ctx: CacheContext, identity: NamespaceIdentity, layout: KVLayout, hash_key: bytes
    ) -> None:
        self._ctx = ctx
        self.identity = identity
        self.layout = layout
        self._hash_key = hash_key
        self._removals = removals.counter_name(identity.namespace_id)

    @property
    def tenant(self) -> str:
        return self.identity.tenant

    @property
    def block_tokens(self) -> int:
        """Tokens per block in this namespace (64 unless it was opened with another size)."""
        return self.identity.block_tokens

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

    def _keys(self, tokens: Any, origin: EditedPrefix | None = None) -> list[BlockKey]:
        """Block keys of ``tokens``: an unedited prefix's, or those of the edited prefix
        ``origin`` (see :meth:`edited` and ``tenantkv.prefix``): the parent's keys for the
        blocks the edit did not touch, then the edited chain."""
        token_array = (
            tokens  # already what as_token_array makes (lookup and store pass theirs)
            if isinstance(tokens, np.ndarray)
            and tokens.dtype == np.uint32
            and tokens.ndim == 1
            and tokens.flags.c_contiguous
            else as_token_array(tokens)
        )
        fingerprint = self.identity.fingerprint
        if origin is None:
            return block_keys(self._hash_key, fingerprint, token_array, self.block_tokens)
        self._check_origin(origin)
        shared = origin.shared_blocks * self.block_tokens
        head = self._keys(token_array[:shared], origin.parent)
        if len(token_array) <= shared:
            return head
        previous: bytes = head[-1] if head else fingerprint
        seed: Fingerprint | EditSeed = edit_seed(self._hash_key, previous, origin.binding)
        return head + block_keys(self._hash_key, seed, token_array[shared:], self.block_tokens)

    def _check_origin(self, origin: Any) -> None:
        if not isinstance(origin, EditedPrefix):
            raise InvalidRequestError(
                f"origin must be an EditedPrefix, got {type(origin).__name__}"
            )
        if origin.namespace_id != self.identity.namespace_id:
            raise InvalidRequestError("this edited prefix belongs to another namespace")

    def edited(
        self, parent_tokens: Any, script: EditScript, *, origin: EditedPrefix | None = None
    ) -> EditedPrefix | None:
        """Where the prefix made by ``script`` from the cached prefix ``parent_tokens`` (whole
        blocks; itself the edited prefix ``origin`` when given) lives.

        The result is passed as ``origin=`` to :meth:`lookup`, :meth:`store` and :meth:`load`
        together with the edited token sequence (the retained tokens, then any later ones).
        When ``script`` drops nothing from ``parent_tokens`` the parent's cache is unchanged and
        its own ``origin`` (None for an unedited prefix) is returned: the edited sequence is then
        an ordinary extension of the parent. Pure key derivation: nothing is read or written.
        """
        if not isinstance(script, EditScript):
            raise InvalidRequestError(f"script must be an EditScript, got {type(script).__name__}")
        token_array = as_token_array(parent_tokens)
        if len(token_array) == 0 or len(token_array) % self.block_tokens:
            raise InvalidRequestError(
                f"an edit applies to a cached prefix of whole {self.block_tokens}-token blocks, "
                f"got {len(token_array)} tokens"
            )
        cut = script.within(len(token_array))
        if cut.is_empty:
            return origin
        parent_key = self._keys(token_array, origin)[-1]
        return EditedPrefix(
            self.identity.namespace_id,
            edit_binding(self._hash_key, parent_key, cut.canonical_bytes()),
            origin,
            shared_blocks=cut.drops[0][0] // self.block_tokens,
            depth=1 if origin is None else origin.depth + 1,
            dropped_tokens=cut.dropped_tokens() + (0 if origin is None else origin.dropped_tokens),
        )

    def _present_keys(self, keys: Sequence[BlockKey], *, stop_at_gap: bool) -> set[bytes]:
        """The subset of ``keys`` that is indexed (see ``index.blocks.present_keys``)."""
        with self._ctx.index.read() as session:
            return blocks.present_keys(
                session,
                self.identity.namespace_id,
                keys,
                self._ctx.clock(),
                stop_at_gap=stop_at_gap,
            )

    @staticmethod
    def _run_from_zero(keys: Sequence[BlockKey], present: set[bytes] | dict[bytes, Any]) -> int:
        count = 0
        for key in keys:
            if key not in present:
                break
            count += 1
        return count

    def _cached_blocks(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first, are cached now: the answer of a lookup.

        The keys this node holds for the namespace (``tenantkv.components.lookup_cache``) answer
        for as long a run as they cover, and one statement checks that nothing left the namespace
        since they were read and asks about the first key past the run. Only when that key is
        present (blocks stored since), or the held keys are stale, does the index get asked
        about more keys (in chunks, as every lookup used to), and what it finds is held next.
        """
        if not keys:
            return 0
        namespace_id = self.identity.namespace_id
        lookups = self._ctx.lookups
        now = self._ctx.clock()
        held = lookups.held(namespace_id)
        run = 0 if held is None else held.run(keys, now)
        probe = keys[run] if run < len(keys) else None
        with self._ctx.index.read_connection() as connection:
            check = blocks.check_lookup(connection, namespace_id, self._removals, probe, now)
            if check is None:  # the namespace is gone (its tenant was deleted)
                lookups.forget(namespace_id)
                return 0
            if held is not None and held.removals != check.removals:
                if held.removals > check.removals:  # a restored index: trust nothing held
                    lookups.forget(namespace_id)
                if run:  # blocks left since the held keys were read: ask about them all
                    found = blocks.present_with_expiry(
                        connection, namespace_id, keys, now, stop_at_gap=True
                    )
                    lookups.add(namespace_id, check.removals, found)
                    return self._run_from_zero(keys, found)
            if probe is None:
                return run
            if check.probe_expires_at is None:
                if held is None:  # remember the counter: the next lookup checks against it
                    lookups.add(namespace_id, check.removals, {})
                return run
            found = {probe: check.probe_expires_at}
            found.update(
                blocks.present_with_expiry(
                    connection, namespace_id, keys[run + 1 :], now, stop_at_gap=True
                )
            )
        lookups.add(namespace_id, check.removals, found)
        return run + self._run_from_zero(keys[run:], found)

    # ---- lookup -------------------------------------------------------------------------------

    def lookup(self, tokens: Any, *, origin: EditedPrefix | None = None) -> int:
        """Length of the longest cached prefix of ``tokens`` (whole blocks; 0 on a miss); of
        the edited prefix ``origin`` when given (see :meth:`edited`).

        Index failures degrade to 0 (logged, counted, not metered) unless the cache was opened
        with ``strict=True``.
        """
        self._ctx.runtime.check_open()
        token_array = as_token_array(tokens)
        keys = self._keys(token_array, origin)
        try:
            hit = self._cached_blocks(keys) * self.block_tokens
        except SQLAlchemyError as err:
            # An index outage is the operator's, not a miss to bill to the tenant.
            return self._ctx.serving.degrade("lookup", err, 0)
        self._meter(hit_tokens=hit, miss_tokens=len(token_array) - hit)
        self._ctx.metrics.looked_up(self.tenant, hit, len(token_array) - hit)
        return hit

    def cached_length(self, tokens: Any, *, origin: EditedPrefix | None = None) -> int:
        """Like :meth:`lookup`, but not metered: for a writer deciding what to pass to
        :meth:`store` (``start=``), not for answering requests. Failures degrade to 0."""
        self._ctx.runtime.check_open()
        keys = self._keys(tokens, origin)
        try:
            return self._cached_blocks(keys) * self.block_tokens
        except SQLAlchemyError as err:
            return self._ctx.serving.degrade("cached_length", err, 0)

    def record_request(self, hit_tokens: int, miss_tokens: int) -> None:
        """Meter a served request's hit and miss tokens, as :meth:`lookup` would have.

        For engines (the vLLM connector) whose scheduler asks :meth:`cached_length`, which must
        be side-effect free because it is asked again and again, and which only know when the
        request finishes what was really served from the cache."""
        if hit_tokens < 0 or miss_tokens < 0:
            raise InvalidRequestError("token counts must not be negative")
        self._ctx.runtime.check_open()
        self._meter(hit_tokens=hit_tokens, miss_tokens=miss_tokens)
        self._ctx.metrics.looked_up(self.tenant, hit_tokens, miss_tokens)

    # ---- store --------------------------------------------------------------------------------

    def store(
        self,
        tokens: Any,
        layers: Sequence[Any],
        *,
        kind: str = DEFAULT_KIND,
        start: int = 0,
        origin: EditedPrefix | None = None,
    ) -> int:
        """Store the full blocks (64 tokens unless the namespace chose another size) of
        ``tokens`` that are not cached yet.

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
        raises QuotaExceededError. With ``origin`` (see :meth:`edited`) ``tokens`` is an edited
        prefix's token sequence, keyed on that edited prefix's chain.
        """
        self._ctx.runtime.check_open()
        token_array = as_token_array(tokens)
        if (
            isinstance(start, bool)
            or not isinstance(start, int)
            or not 0 <= start <= len(token_array)
            or start % self.block_tokens
        ):
            raise InvalidRequestError(
                f"start must be a multiple of {self.block_tokens} within the {len(token_array)} "
                f"tokens, got {start!r}"
            )
        rows = self.layout.validate_layers(layers, len(token_array) - start)
        check_kind(kind)
        keys = self._keys(token_array, origin)
        try:
            settings = self._tenant_settings()
            if kind not in settings[3]:
                raise InvalidRequestError(
                    f"unknown retention class {kind!r}; tenant {self.tenant!r} has "
                    f"{', '.join(sorted(settings[3]))}"
                )
            if not keys:
                return 0
            first_row_block = start // self.block_tokens
            # Blocks before ``start`` are never written here (their KV was not passed), so only
            # the keys from ``start`` on are asked for: a long conversation's next turn queries
            # its new blocks, not the whole prefix again.
            present = self._present_keys(keys[first_row_block:], stop_at_gap=False)
            positions = [i for i in range(first_row_block, len(keys)) if keys[i] not in present]
            if not positions:
                return 0
            return self._store_blocks(keys, positions, rows, first_row_block, kind, settings)
        except (SQLAlchemyError, StorageError) as err:
            return self._ctx.serving.degrade("store", err, 0)

    def _tenant_settings(self) -> tuple[int, bytes, int, dict[str, float]]:
        """(key version, data key, quota bytes, retention) of the tenant, now."""
        with self._ctx.index.read() as session:
            settings = blocks.write_settings(session, self.identity.tenant_id)
        if settings is None:
            raise TenantNotFoundError(f"tenant {self.tenant!r} no longer exists")
        version = settings.key_version
        if settings.wrapped_key is None:
            raise CacheUnavailableError(f"tenant {self.tenant!r} has no data key {version}")
        data_key = self._ctx.keys.data_key(self.identity.tenant_id, version, settings.wrapped_key)
        return version, data_key, settings.quota_bytes, loads_retention(settings.retention)

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
        suite = self._ctx.config.suite
        geometry = ExtentGeometry(
            num_blocks=len(positions),
            num_layers=self.layout.num_layers,
            segment_bytes=self.block_tokens * self.layout.token_bytes,
            suite=suite,
        )
        if geometry.total_bytes > quota:
            self._ctx.incidents.record(
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
        extent_id = self._write_extent(
            geometry, cipher, keys, positions, rows, first_row_block, retention[kind]
        )
        try:
            inserted, evicted = self._index_extent(
                extent_id, geometry, key_version, salt, keys, positions, kind, retention[kind]
            )
        except BaseException as err:
            self._ctx.blocks.delete(extent_id)
            if isinstance(err, QuotaExceededError):
                self._ctx.incidents.record("quota_refused", self.tenant, str(err), QUOTA_REFUSED)
            raise
        if inserted == 0:
            self._ctx.blocks.delete(extent_id)  # another writer indexed these blocks first
        discard_evicted(self._ctx, self.identity.tenant_id, evicted, self.tenant)
        if inserted:
            self._meter(
                stored_tokens=inserted * self.block_tokens, stored_bytes=geometry.total_bytes
            )
            self._ctx.metrics.stored(self.tenant, geometry.total_bytes)
        return inserted * self.block_tokens

    def _seal_and_write(
        self,
        writer: ExtentWriter,
        geometry: ExtentGeometry,
        cipher: ExtentCipher,
        layer: int,
        first_slot: int,
        keys: list[BlockKey],
        positions: list[int],
        rows: torch.Tensor,
        first_row_block: int,
    ) -> None:
        """Worker: seal the new segments ``first_slot ..`` (``len(positions)`` of them) of one
        layer into the writer's scratch memory and write them with one ``write_at``.

        ``rows`` starts at block ``first_row_block`` of the prefix (see ``store(start=)``).
        """
        plain = geometry.segment_bytes
        offset = geometry.offset(layer, first_slot)
        out = writer.scratch(offset, len(positions) * geometry.sealed_bytes)
        source = memoryview(rows.numpy()).cast("B")  # type: ignore[arg-type]
        plaintexts = []
        for position in positions:
            row_block = position - first_row_block
            assert row_block >= 0, "a stored block lies before the rows the caller passed"
            plaintexts.append(source[row_block * plain : (row_block + 1) * plain])
        cipher.seal_many_into(
            first_slot, layer, [keys[position] for position in positions], plaintexts, out
        )
        writer.write_at(offset, out)

    def _write_extent(
        self,
        geometry: ExtentGeometry,
        cipher: ExtentCipher,
        keys: list[BlockKey],
        positions: list[int],
        rows: list[torch.Tensor],
        first_row_block: int,
        retain_for: float,
    ) -> str:
        """Seal and write the extent on the worker pool, a bounded window of pieces at a time;
        then commit (``retain_for``: the class's retention, for stores that expire extents
        themselves).

        A piece is up to ``STORE_PIECE_BYTES`` of one layer's segments: pieces go to disjoint
        offsets, so workers seal and write them in parallel (one ``write_at`` each; one worker
        seals while another waits on its write), no piece waits for another, and a worker's
        scratch memory stays bounded however long the prefix. The window keeps a large store
        from queueing all its pieces ahead of concurrent loads on the shared pool.
        """
        executor = self._ctx.runtime.seal_executor
        # Two pieces queued per worker: a worker that finishes one starts the next at once
        # instead of waiting for this thread to be scheduled and submit it.
        window = max(self._ctx.runtime.window, 2 * self._ctx.runtime.workers)
        per_piece = max(1, STORE_PIECE_BYTES // geometry.sealed_bytes)
        pieces = [
            (layer, first)
            for layer in range(geometry.num_layers)
            for first in range(0, geometry.num_blocks, per_piece)
        ]
        with self._ctx.blocks.create() as writer:
            writer.reserve(geometry.total_bytes)
            writer.write_at(0, geometry.header())
            pending: set[Future[None]] = set()
            try:
                for layer, first in pieces:
                    if len(pending) >= window:
                        done, pending = wait_futures(pending, return_when=FIRST_COMPLETED)
                        for future in done:
                            future.result()
                    pending.add(
                        executor.submit(
                            self._seal_and_write,
                            writer,
                            geometry,
                            cipher,
                            layer,
                            first,
                            keys,
                            positions[first : first + per_piece],
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
            return writer.commit(retain_for=retain_for)

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
        now = self._ctx.clock()
        namespace_id = self.identity.namespace_id
        tenant_id = self.identity.tenant_id
        evicted: list[Evicted] = []
        with self._ctx.index.write() as session:
            quota = blocks.lock_quota(session, tenant_id)
            if quota is None:
                raise TenantNotFoundError(f"tenant {self.tenant!r} no longer exists")
            extent = Extent(
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
            inserted = blocks.index_blocks(self._ctx.index, session, extent, keys, positions)
            if inserted:
                evicted = make_room(
                    session,
                    tenant_id,
                    quota,
                    now,
                    held=lambda ids: self._ctx.leases.held(session, ids),
                    keep=extent_id,
                )
        return inserted, evicted

    # ---- load ---------------------------------------------------------------------------------

    def load(
        self,
        tokens: Any,
        device: str | torch.device = "cpu",
        *,
        out: Sequence[Any] | None = None,
        block_rows: Sequence[int] | None = None,
        origin: EditedPrefix | None = None,
    ) -> LoadStream:
        """Stream the cached prefix ``tokens`` (whole blocks, all cached) layer by layer.

        Reading starts at once, in the background; iterate the stream, or call
        ``wait_for_layer(i)``, to receive layers. Without ``out`` every layer is a fresh tensor of
        exactly ``len(tokens)`` rows on ``device``. With ``out`` (one buffer per layer: a tensor
        ``[R, kv_lora_rank + rope_dim]`` for MLA, a ``(k, v)`` pair of ``[R, heads, head_dim]``
        for MHA, contiguous, on ``device``) the layers are written in place and the stream yields
        those same buffers: rows ``0 .. len(tokens) - 1``, or, with ``block_rows``, rows
        ``block_rows[b] .. block_rows[b] + 63`` for block ``b`` (paged KV). Rows outside the loaded
        ones are left untouched.

        With ``origin``, ``tokens`` is the edited prefix ``origin``'s (see :meth:`edited`).

        Raises :class:`CacheMissError` when any block is not cached, :class:`InvalidRequestError`
        for bad arguments, and :class:`SegmentIntegrityError` when an extent is found damaged
        before the first layer.
        """
        self._ctx.runtime.check_open()
        requested = time.perf_counter()  # the start of the load's latency metrics
        # From now until the first layer is handed over, bookkeeping (earlier loads' records of
        # use) waits: it would compete with this load's plan and layer 0 (first_layers.py).
        first_layer = self._ctx.runtime.first_layers.hold()
        try:
            return self._start_load(tokens, device, out, block_rows, origin, requested, first_layer)
        except BaseException:
            first_layer.release()
            raise

    def _start_load(
        self,
        tokens: Any,
        device: str | torch.device,
        out: Sequence[Any] | None,
        block_rows: Sequence[int] | None,
        origin: EditedPrefix | None,
        requested: float,
        first_layer: FirstLayerHold,
    ) -> LoadStream:
        """:meth:`load` up to its stream: the keys, the target, the plan and lease, the readers."""
        target_device = self._parse_device(device)
        token_array = as_token_array(tokens)
        if len(token_array) == 0 or len(token_array) % self.block_tokens:
            raise InvalidRequestError(
                f"load takes a whole number of {self.block_tokens}-token blocks (got "
                f"{len(token_array)} tokens); "
                "use lookup() to find the cached length"
            )
        keys = self._keys(token_array, origin)
        target = LoadTarget(
            self.layout,
            target_device,
            len(keys),
            out,
            block_rows,
            self._ctx.runtime.layer_pool,
            block_tokens=self.block_tokens,
            inputs=[tokens] if isinstance(tokens, torch.Tensor) else (),
        )
        revocations = self._ctx.keys.revocations  # before the plan reads the keys
        try:
            plan, lease = self._plan_and_lease(keys)
        except SQLAlchemyError as err:
            raise self._ctx.serving.load_unavailable(err) from err
        guard = KeyGuard(
            self._ctx.index,
            lambda: self._ctx.keys.revocations,
            self.identity.tenant_id,
            {extent.key_version for extent in plan.extents},
            seen=revocations,
        )
        try:
            readers = open_readers(self._ctx.blocks, plan)
        except ExtentFailure as failure:
            self._ctx.leases.release(lease)
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
        started = self._ctx.clock()
        try:
            stream = LoadStream(
                plan=plan,
                layout=self.layout,
                readers=readers,
                target=target,
                pool=self._ctx.runtime.load_executor,
                ring=self._ctx.runtime.staging_ring(pinned=target.device.type == "cuda"),
                window=self._ctx.runtime.window,
                workers=self._ctx.runtime.load_threads,
                on_failure=self._handle_failure,
                # A deletion or key retirement ends the load before its next layer.
                keys_exist=guard.keys_exist,
                # Record the use after the load, off its critical path (the index write would
                # otherwise compete for the interpreter with the first layer's workers).
                on_close=lambda stream: self._finish_load(
                    stream, lease, extent_ids, started, requested
                ),
                on_first_layer=first_layer.release,
            )
        except BaseException:
            self._ctx.leases.release(lease)
            for reader in readers.values():
                reader.close()
            raise
        # A stream dropped unclosed lets go of the gate when it is collected.
        weakref.finalize(stream, first_layer.release)
        self._ctx.runtime.track_stream(stream)
        return stream

    def prefetch(self, tokens: Any, *, origin: EditedPrefix | None = None) -> int:
        """Start reading the longest cached prefix of ``tokens`` into memory; return its length.

        Asks the block store to read the prefix's byte ranges ahead (the OS page cache for the
        local store) and returns at once, so a later ``load`` of the prefix finds its bytes in
        memory. Holds no buffers or threads of its own; a prefetch that is never followed by a
        load costs only the read. Failures degrade to 0.
        """
        self._ctx.runtime.check_open()
        keys = self._keys(tokens, origin)
        try:
            cached = self._cached_blocks(keys)
            if cached == 0:
                return 0
            with self._ctx.index.read_connection() as connection:
                plan = self._plan(connection, keys[:cached])
            for run in plan.runs:
                geometry = run.extent.geometry
                ranges = [
                    (geometry.offset(layer, run.first_slot), run.count * geometry.sealed_bytes)
                    for layer in range(geometry.num_layers)
                ]
                self._ctx.blocks.prefetch(run.extent.extent_id, ranges)
        except (SQLAlchemyError, StorageError, CacheMissError) as err:
            return self._ctx.serving.degrade("prefetch", err, 0)
        return cached * self.block_tokens

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
        """The read plan of ``keys`` (one read transaction) and a lease on its extents: held on
        this node at once, its row written in the background, so the first layer waits on no
        index write (a write transaction here queued behind other writers' locks and cost
        milliseconds of time to first layer on SQLite; see docs/perf.md)."""
        with self._ctx.index.read_connection() as connection:
            plan = self._plan(connection, keys)
        lease = self._ctx.leases.take([e.extent_id for e in plan.extents])
        return plan, lease

    def _plan(self, connection: Connection, keys: list[BlockKey]) -> ReadPlan:
        """Where every block of ``keys`` lies, with the cipher of each extent; or CacheMissError.

        Every block must be indexed in this namespace with an unexpired extent, whose key
        version still exists and whose geometry matches this namespace's layout.
        """
        identity = self.identity
        located, rows_by_extent = locate_blocks(
            connection,
            tenant_id=identity.tenant_id,
            namespace_id=identity.namespace_id,
            keys=keys,
            now=self._ctx.clock(),
            prefix=True,
        )
        cached = self._run_from_zero(keys, located)
        if cached < len(keys):
            raise CacheMissError(
                f"only {cached * self.block_tokens} of {len(keys) * self.block_tokens} tokens "
                "are cached"
            )
        planned = {
            extent_id: self._planned_extent(row) for extent_id, row in rows_by_extent.items()
        }
        return group_runs(keys, located, planned)

    def _planned_extent(self, row: ExtentRow) -> PlannedExtent:
        """The geometry and cipher of one indexed extent, after checking it fits this namespace."""
        if row.wrapped_key is None:
            raise CacheMissError(f"data key version {row.key_version} is gone")
        geometry = ExtentGeometry(
            row.num_blocks, row.num_layers, row.segment_bytes, CipherSuite(row.suite)
        )
        if geometry.num_layers != self.layout.num_layers or geometry.segment_bytes != (
            self.block_tokens * self.layout.token_bytes
        ):
            raise CacheMissError("an indexed extent does not match this namespace's layout")
        context = SegmentContext(
            self.identity.tenant_id, row.key_version, self.identity.namespace_id
        )
        cipher = self._ctx.keys.extent_cipher(context, row.wrapped_key, row.salt, geometry.suite)
        return PlannedExtent(row.extent_id, geometry, cipher, row.key_version)

    def _finish_load(
        self,
        stream: LoadStream,
        lease: bytes,
        extent_ids: list[str],
        started: float,
        requested: float,
    ) -> None:
        """After a load: end its lease now (so eviction, GC and re-sealing see the extents as
        free the moment the load is closed, whatever the background pool is doing), meter it,
        observe it in the metrics (here, once per load, off the path to its layers), and record
        its use (written in a batch in the background, use_records.py)."""
        self._ctx.leases.release(lease, remove_unindexed=False)
        delivered = stream.delivered_layers
        if delivered == stream.num_layers:
            self._meter(served_tokens=stream.num_tokens)
        first, last = stream.first_layer_at, stream.last_handed_at
        self._ctx.metrics.loaded(
            self.tenant,
            delivered * stream.num_tokens * self.layout.token_bytes,
            seconds=last - requested
            if last is not None and delivered == stream.num_layers
            else None,
            first_layer_seconds=None if first is None else first - requested,
        )
        self._ctx.uses.record(self.identity.tenant_id, extent_ids, started)

    def _meter(self, **counts: int) -> None:
        self._ctx.meter.add(self.identity.tenant_id, self.scope or "", self._ctx.clock(), **counts)

    # ---- failures -----------------------------------------------------------------------------

    def _handle_failure(self, failure: ExtentFailure) -> None:
        """Integrity: drop the extent and record a security event. Lost: drop it from the index
        and count it. I/O: log it (the bytes may well be intact)."""
        if failure.integrity:
            self._ctx.incidents.record(
                "segment_open_failed",
                self.tenant,
                f"extent {failure.extent_id} layer {failure.layer}: {failure.cause}",
                SEGMENT_OPEN_FAILED,
            )
            self._ctx.remover.drop_now(failure.extent_id)
        elif failure.lost:
            # Not evidence of an attack (a shared tier evicted it, a disk lost it): the index
            # forgets it, so later lookups miss, and operators see a counter.
            logger.warning("extent %s is lost: %s", failure.extent_id, failure.cause)
            self._ctx.health.count(LOST_EXTENTS)
            self._ctx.remover.drop_now(failure.extent_id)
        else:
            logger.warning("reading extent %s failed: %s", failure.extent_id, failure.cause)

    def cached_blocks(self) -> Iterator[int]:
        """Positions of this namespace's cached blocks (for checks and tests; no token data)."""
        with self._ctx.index.read() as session:
            yield from blocks.cached_positions(session, self.identity.namespace_id)


_MAX_SCOPE = 256
_MAX_MODEL = 256


def _check_label(what: str, value: Any, limit: int) -> str:
    if not isinstance(value, str) or not value or len(value) > limit or not value.isprintable():
        raise InvalidRequestError(f"{what} must be a printable string of 1-{limit} characters")
    return value


def open_namespace(
    ctx: CacheContext,
    tenant: str,
    *,
    model: str,
    layout: KVLayout,
    scope: str | None,
    revision: str | None,
    block_tokens: int = BLOCK_TOKENS,
) -> Namespace:
    """The namespace of ``tenant`` (and ``scope``) for a model and layout; made on first use."""
    check_tenant_name(tenant)
    _check_label("model", model, _MAX_MODEL)
    if scope is not None:
        _check_label("scope", scope, _MAX_SCOPE)
    if revision is not None:
        _check_label("revision", revision, _MAX_MODEL)
    if not isinstance(layout, KVLayout):
        raise InvalidRequestError("layout must be a tenantkv.KVLayout")
    if (
        isinstance(block_tokens, bool)
        or not isinstance(block_tokens, int)
        or not 0 < block_tokens <= MAX_BLOCK_TOKENS
        or block_tokens % BLOCK_TOKENS_STEP
    ):
        raise InvalidRequestError(
            f"block_tokens must be a multiple of {BLOCK_TOKENS_STEP} from {BLOCK_TOKENS_STEP} "
            f"to {MAX_BLOCK_TOKENS}, got {block_tokens!r}"
        )
    fingerprint = model_fingerprint(
        model, revision, layout_identity(layout.describe(), block_tokens)
    )
    scope_value = scope or ""
    for _attempt in range(2):
        with ctx.index.read() as session:
            tenant_id, row = namespaces.find(session, tenant, scope_value, fingerprint.hex())
        if tenant_id is None:
            raise TenantNotFoundError(f"no tenant named {tenant!r}")
        if row is None:
            namespace_id = secrets.token_bytes(16)
            row = NamespaceRow(
                id=namespace_id,
                tenant_id=tenant_id,
                scope=scope_value,
                model=model,
                fingerprint=fingerprint.hex(),
                wrapped_hash_key=ctx.keys.new_namespace_key(tenant_id, namespace_id),
                created_at=ctx.clock(),
            )
            if not namespaces.create(ctx.index, row):
                continue  # lost a creation race; read the winner's row
        hash_key = ctx.keys.namespace_key(tenant_id, row.id, row.wrapped_hash_key)
        identity = NamespaceIdentity(
            row.id, tenant_id, tenant, scope, model, fingerprint, block_tokens
        )
        return Namespace(ctx, identity, layout, hash_key)
    raise RuntimeError("namespace creation did not converge")  # pragma: no cover
