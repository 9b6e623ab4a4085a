"""A namespace's writes: ``store``'s index side around the data path's sealing.

``store`` validates its input, finds which full blocks are new, refuses a store larger than the
tenant's quota, has ``tenantkv.datapath.sealing`` seal the new blocks into one extent under the
tenant's current data key, then indexes the extent in one write transaction that also evicts the
tenant's least recently used extents to make room (``index/quota.py``). Metering and the store
metrics count only blocks this writer indexed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from sqlalchemy.exc import SQLAlchemyError

from ..audit import QUOTA_REFUSED
from ..crypto import ExtentCipher, SegmentContext, new_salt
from ..datapath.extent_format import ExtentGeometry
from ..datapath.sealing import seal_extent
from ..editing.lineage import EditedPrefix
from ..errors import (
    CacheUnavailableError,
    InvalidRequestError,
    QuotaExceededError,
    TenantNotFoundError,
)
from ..index import blocks
from ..index.quota import Evicted, make_room
from ..index.schema import Extent
from ..prefix import BlockKey
from ..retention import DEFAULT_KIND, check_kind
from ..retention import loads as loads_retention
from ..storage import StorageError
from ..tokens import as_token_array
from .evictions import discard_evicted
from .namespace_keys import NamespaceKeys


class NamespaceWrites(NamespaceKeys):
    """Store the new full blocks of a namespace's prefixes."""

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
            settings = self._tenant_settings(kind)
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

    def store_pages(
        self, pages: Sequence[Any], layers: Sequence[Any], *, kind: str = DEFAULT_KIND
    ) -> int:
        """Store independent one-block prefixes (``pages``: each a block of tokens, keyed on
        its own) in one extent; returns the tokens newly stored.

        For engines that cache pages under their own hashes rather than as one prompt (SGLang's
        HiCache hands a batch of pages at once): one extent, one index transaction and one
        sealing pass per batch instead of per page. ``layers`` covers the pages in order, as
        for :meth:`store` over ``len(pages) * block_tokens`` tokens. Each page is found again by
        :meth:`lookup` / :meth:`load` of its own tokens. Pages already cached are skipped; the
        same failure rules as :meth:`store` apply (nothing indexed unless all of it is).
        """
        self._ctx.runtime.check_open()
        arrays = [as_token_array(page) for page in pages]
        for array in arrays:
            if len(array) != self.block_tokens:
                raise InvalidRequestError(
                    f"a page must be {self.block_tokens} tokens, got {len(array)}"
                )
        rows = self.layout.validate_layers(layers, len(arrays) * self.block_tokens)
        check_kind(kind)
        if not arrays:
            return 0
        keys = [self._keys(array)[0] for array in arrays]
        try:
            settings = self._tenant_settings(kind)
            present = self._present_keys(keys, stop_at_gap=False)
            positions = []
            for index, key in enumerate(keys):
                if key not in present:
                    present.add(key)  # a page repeated in the batch is stored once
                    positions.append(index)
            if not positions:
                return 0
            return self._store_blocks(keys, positions, rows, 0, kind, settings)
        except (SQLAlchemyError, StorageError) as err:
            return self._ctx.serving.degrade("store", err, 0)

    def _present_keys(self, keys: Sequence[BlockKey], *, stop_at_gap: bool) -> set[bytes]:
        """The subset of ``keys`` that is indexed (see ``index.blocks.present_keys``)."""
        with self._ctx.index.read(serving=True) as session:
            return blocks.present_keys(
                session,
                self.identity.namespace_id,
                keys,
                self._ctx.clock(),
                stop_at_gap=stop_at_gap,
            )

    def _tenant_settings(self, kind: str) -> tuple[int, bytes, int, dict[str, float]]:
        """(key version, data key, quota bytes, retention) of the tenant, now, for a store of
        retention class ``kind`` (an :class:`InvalidRequestError` when the tenant has no such
        class: the classes are the tenant's, so this is where they are read)."""
        with self._ctx.index.read(serving=True) as session:
            settings = blocks.write_settings(session, self.identity.tenant_id)
        if settings is None:
            raise TenantNotFoundError(f"tenant {self.tenant!r} no longer exists")
        version = settings.key_version
        if settings.wrapped_key is None:
            raise CacheUnavailableError(f"tenant {self.tenant!r} has no data key {version}")
        data_key = self._ctx.keys.data_key(self.identity.tenant_id, version, settings.wrapped_key)
        retention = loads_retention(settings.retention)
        if kind not in retention:
            raise InvalidRequestError(
                f"unknown retention class {kind!r}; tenant {self.tenant!r} has "
                f"{', '.join(sorted(retention))}"
            )
        return version, data_key, settings.quota_bytes, retention

    def _store_blocks(
        self,
        keys: list[BlockKey],
        positions: list[int],
        rows: list[torch.Tensor],
        first_row_block: int,
        kind: str,
        settings: tuple[int, bytes, int, dict[str, float]],
    ) -> int:
        """Seal the blocks at ``positions`` into one new extent (``datapath/sealing.py``) and
        index it; return the tokens newly stored. The extent's bytes go again when indexing
        fails, or when another writer indexed all these blocks first."""
        key_version, data_key, quota, retention = settings
        suite = self._ctx.config.suite
        layout = self.layout
        geometry = ExtentGeometry(
            num_blocks=len(positions),
            num_layers=layout.num_layers,
            segment_bytes=layout.segment_bytes(self.block_tokens),
            suite=suite,
            codec=layout.coder.ident,
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
        context = SegmentContext(
            self.identity.tenant_id, key_version, self.identity.namespace_id, geometry.codec
        )
        cipher = ExtentCipher(data_key, salt, context, suite)
        runtime = self._ctx.runtime
        extent_id = seal_extent(
            self._ctx.blocks,
            geometry,
            cipher,
            keys=keys,
            positions=positions,
            # The codec stage: a lossy codec's segments are encoded here, before sealing (and
            # after the quota check, so a refused store encodes nothing).
            rows=[layout.encode_rows(layer_rows, self.block_tokens) for layer_rows in rows],
            first_row_block=first_row_block,
            executor=runtime.seal_executor,
            workers=runtime.workers,
            window=runtime.window,
            retain_for=retention[kind],
            owner=str(self.identity.tenant_id),
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
        with self._ctx.index.write(serving=True) as session:
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
