"""A namespace: one tenant's (optionally scoped) cache for one model fingerprint.

``store`` seals new full blocks into one layer-major extent and indexes them (``writes.py``, over
``tenantkv.datapath.sealing``); ``lookup`` finds the longest cached prefix and ``prefetch`` reads
one ahead (``reads.py``); ``load`` streams a cached prefix layer by layer (here: it joins a read
plan to the data path's loader). Nothing is shared across namespaces: each has its own hashing
key, so identical tokens give unrelated block keys (``namespace_keys.py``).
"""

from __future__ import annotations

import secrets
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from sqlalchemy.exc import SQLAlchemyError

from ..components.context import CacheContext
from ..components.key_guard import KeyGuard
from ..datapath.first_layers import FirstLayerHold
from ..datapath.load_targets import LoadTarget
from ..datapath.load_workers import FailureHandler
from ..datapath.loader import ExtentFailure, LoadStream, open_readers
from ..datapath.read_plan import PlannedExtent, ReadPlan, group_runs
from ..editing.lineage import EditedPrefix
from ..errors import (
    CacheMissError,
    InvalidRequestError,
    LoadError,
    SegmentIntegrityError,
    TenantNotFoundError,
)
from ..index import namespaces
from ..index.failures import typed_failures
from ..index.plan import locate_blocks
from ..index.schema import Namespace as NamespaceRow
from ..layout import KVLayout, Layer
from ..prefix import (
    BLOCK_TOKENS,
    BLOCK_TOKENS_STEP,
    MAX_BLOCK_TOKENS,
    BlockKey,
    layout_identity,
    model_fingerprint,
)
from ..tokens import as_token_array
from .namespace_keys import NamespaceIdentity
from .reads import NamespaceReads
from .tenants import check_tenant_name
from .writes import NamespaceWrites


@typed_failures
class Namespace(NamespaceReads, NamespaceWrites):
    """Store, look up and load prefix caches of one (tenant, scope, model fingerprint).

    One object to callers, its methods grouped by job: reads in :class:`NamespaceReads`
    (``reads.py``), writes in :class:`NamespaceWrites` (``writes.py``), both over the keys of
    ``namespace_keys.py``; ``load``, which joins a read plan to the loader, is here.

    Serving calls degrade as the serving policy says (``components/serving.py``); every other
    public method raises CacheUnavailableError where the index or block store fails
    (``typed_failures``), never a driver's error.
    """

    def __repr__(self) -> str:
        return (
            f"Namespace(tenant={self.tenant!r}, scope={self.scope!r}, model={self.model!r}, "
            f"layout={self.layout.kind})"
        )

    # ---- load ---------------------------------------------------------------------------------

    def load(
        self,
        tokens: Any,
        device: str | torch.device = "cpu",
        *,
        out: Sequence[Any] | None = None,
        block_rows: Sequence[int] | None = None,
        origin: EditedPrefix | None = None,
        skip_blocks: int = 0,
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

        With ``skip_blocks``, the prefix's first ``skip_blocks`` blocks are neither read nor
        returned: the caller has them (an engine's own prefix cache holds them), and reading
        them would decrypt what it then throws away. The layers hold the remaining blocks only
        (``block_rows`` then has one entry per remaining block), and only those are looked up;
        their keys still chain from the whole of ``tokens``, so they are the blocks that follow
        exactly this prefix, in this tenant's namespace.

        Raises :class:`CacheMissError` when any block is not cached, or when the index or block
        store fails before the first layer (counted as ``degraded_load``;
        :class:`CacheUnavailableError` instead with ``strict=True``), :class:`InvalidRequestError`
        for bad arguments, and :class:`SegmentIntegrityError` when an extent is found damaged
        before the first layer.
        """
        self._ctx.runtime.check_open()
        requested = time.perf_counter()  # the start of the load's latency metrics
        # From now until the first layer is handed over, bookkeeping (earlier loads' records of
        # use) waits: it would compete with this load's plan and layer 0 (first_layers.py).
        first_layer = self._ctx.runtime.first_layers.hold()
        try:
            return self._start_load(
                tokens, device, out, block_rows, origin, skip_blocks, requested, first_layer
            )
        except BaseException:
            first_layer.release()
            raise

    def load_pages(
        self, pages: Sequence[Any], device: str | torch.device = "cpu"
    ) -> list[list[Layer] | None]:
        """Load independent one-block prefixes (each page a block of tokens keyed on its own,
        as :meth:`store_pages` stores them): per page, its layers (``block_tokens`` rows each,
        views of the batch's fresh layers), or None where the page is not cached.

        For engines that fetch a batch of pages at once (SGLang's HiCache): the pages found are
        planned together, sorted by where they lie, so pages stored in one extent are read with
        one open and one read per layer (one run) instead of one load per page. Pages stay
        independent: a page that is not cached, or whose extent cannot be planned (its key
        version gone), is a miss for that page only. When the batch's read fails (an extent
        damaged, lost or unreadable, the tenant's keys revoked), its pages are loaded again one
        by one, and each of those loads records and drops what it finds damaged exactly as
        :meth:`load` does: a damaged page is a miss and a security event (its extent dropped,
        so its extent's pages asked for after it miss too), the pages asked for before it are
        still served, and no page is ever served bytes that failed to open.

        Raises :class:`InvalidRequestError` for a page that is not one block, and what
        :meth:`load` raises when the index fails before the plan (a miss, counted as
        ``degraded_load``, or :class:`CacheUnavailableError` with ``strict=True``).
        """
        self._ctx.runtime.check_open()
        target_device = self._parse_device(device)
        arrays = [as_token_array(page) for page in pages]
        for array in arrays:
            if len(array) != self.block_tokens:
                raise InvalidRequestError(
                    f"a page must be {self.block_tokens} tokens, got {len(array)}"
                )
        if not arrays:
            return []
        keys = [self._keys(array)[0] for array in arrays]
        requested = time.perf_counter()
        first_layer = self._ctx.runtime.first_layers.hold()
        try:
            batch = self._load_page_batch(keys, target_device, requested, first_layer)
        finally:  # the stream let go of it at its first layer, if it had one; again is nothing
            first_layer.release()
        if batch is not None:
            return [batch.get(key) for key in keys]
        # The batch's read failed: each page on its own, so that only the pages whose own
        # bytes fail miss, and every failure is recorded by the load that meets it.
        found: list[list[Layer] | None] = []
        for array in arrays:
            try:
                with self.load(array, target_device) as stream:
                    found.append([layer for _index, layer in stream])
            except (CacheMissError, LoadError):
                found.append(None)
        return found

    def _load_page_batch(
        self,
        keys: list[BlockKey],
        device: torch.device,
        requested: float,
        first_layer: FirstLayerHold,
    ) -> dict[bytes, list[Layer]] | None:
        """The layers of every page of ``keys`` that is cached, by key, read as one load over
        the pages in (extent, slot) order; None when that load failed (the caller retries the
        pages one by one; nothing was recorded or dropped here)."""
        revocations = self._ctx.keys.revocations  # before the plan reads the keys
        identity = self.identity
        try:
            with self._ctx.index.read_connection(serving=True) as connection:
                located, rows = locate_blocks(
                    connection,
                    tenant_id=identity.tenant_id,
                    namespace_id=identity.namespace_id,
                    keys=list(dict.fromkeys(keys)),
                    now=self._ctx.clock(),
                )
        except SQLAlchemyError as err:
            raise self._ctx.serving.load_unavailable(err) from err
        planned: dict[str, PlannedExtent] = {}
        for extent_id, row in rows.items():
            try:
                planned[extent_id] = self._planned_extent(row)
            except CacheMissError:  # its key version is gone, or another layout: its pages miss
                continue
        present = sorted(
            (place for place in located.items() if place[1][0] in planned),
            key=lambda item: item[1],
        )
        if not present:
            return {}
        ordered = [BlockKey(key) for key, _place in present]
        plan = group_runs(ordered, located, planned)
        target = LoadTarget(
            self.layout,
            device,
            len(ordered),
            None,
            None,
            self._ctx.runtime.layer_pool,
            block_tokens=self.block_tokens,
        )
        lease = self._ctx.leases.take([extent.extent_id for extent in plan.extents])
        try:
            with self._stream(
                plan, lease, target, revocations, requested, first_layer, _defer
            ) as stream:
                layers = [layer for _index, layer in stream]
        except (CacheMissError, LoadError):
            return None
        rows_of = self.block_tokens
        return {
            key: [_rows(layer, i * rows_of, rows_of) for layer in layers]
            for i, key in enumerate(ordered)
        }

    def _start_load(
        self,
        tokens: Any,
        device: str | torch.device,
        out: Sequence[Any] | None,
        block_rows: Sequence[int] | None,
        origin: EditedPrefix | None,
        skip_blocks: int,
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
        if isinstance(skip_blocks, bool) or not isinstance(skip_blocks, int):
            raise InvalidRequestError("skip_blocks must be an integer")
        if not 0 <= skip_blocks < len(keys):
            raise InvalidRequestError(
                f"skip_blocks must leave at least one of the prefix's {len(keys)} blocks to "
                f"load (got {skip_blocks})"
            )
        keys = keys[skip_blocks:]
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
        return self._stream(
            plan, lease, target, revocations, requested, first_layer, self._handle_failure
        )

    def _stream(
        self,
        plan: ReadPlan,
        lease: bytes,
        target: LoadTarget,
        revocations: int,
        requested: float,
        first_layer: FirstLayerHold,
        on_failure: FailureHandler,
    ) -> LoadStream:
        """The stream of a planned load whose ``lease`` is held: open the plan's extents and
        start reading. ``on_failure`` hears of every extent that fails (the namespace's
        handler records and drops it; a batch of pages defers that to its per-page retry).
        ``revocations`` is the key epoch read before the plan was."""
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
            on_failure(failure)
            if failure.lost:
                raise CacheMissError(
                    f"a cached extent's bytes are gone ({failure.cause}); the prefix was dropped"
                ) from failure.cause
            if not failure.integrity:
                # The block store is unreachable or failing (Redis down, EIO): the operator's
                # outage, not the tenant's, so a miss counted as ``degraded_load`` (or, strict,
                # CacheUnavailableError), as for an index outage; the bytes stay indexed.
                raise self._ctx.serving.load_unavailable(
                    failure.cause, backend="block store"
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
                on_failure=on_failure,
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


def _defer(failure: ExtentFailure) -> None:
    """A batch of pages' failure handler: nothing yet. The pages are loaded again one by one,
    and the load of the page whose bytes fail records and drops the extent then (once)."""


def _rows(layer: Layer, start: int, count: int) -> Layer:
    """Rows ``start .. start + count`` of a loaded layer (views, no copy)."""
    if isinstance(layer, tuple):
        return layer[0][start : start + count], layer[1][start : start + count]
    return layer[start : start + count]


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
    codec: str | None = None,
) -> Namespace:
    """The namespace of ``tenant`` (and ``scope``) for a model and layout; made on first use.
    ``codec`` (None: the layout's own) is how its values are stored (``tenantkv.codecs``)."""
    check_tenant_name(tenant)
    _check_label("model", model, _MAX_MODEL)
    if scope is not None:
        _check_label("scope", scope, _MAX_SCOPE)
    if revision is not None:
        _check_label("revision", revision, _MAX_MODEL)
    if not isinstance(layout, KVLayout):
        raise InvalidRequestError("layout must be a tenantkv.KVLayout")
    layout = layout.with_codec(layout.codec if codec is None else codec)
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
    layout.check_block_tokens(block_tokens)
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
