"""A namespace's reads: lookup, cached length, prefetch, and the plans that loads start from.

A lookup asks the keys this node holds for the namespace first (``lookup_cache.py``) and the index
only past them; a load's plan (every block's extent, slot and cipher) is one read transaction,
and its lease is held on this node at once (see :meth:`NamespaceReads._plan_and_lease`).
:meth:`~tenantkv.services.namespace.Namespace.load` starts the stream over such a plan, and a
failure of an extent it reads comes back to :meth:`NamespaceReads._handle_failure`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from ..audit import SEGMENT_OPEN_FAILED
from ..components.health import LOST_EXTENTS
from ..crypto import CipherSuite, SegmentContext
from ..datapath.extent_format import ExtentGeometry
from ..datapath.loader import ExtentFailure, LoadStream
from ..datapath.read_plan import PlannedExtent, ReadPlan, group_runs
from ..editing.lineage import EditedPrefix
from ..errors import CacheMissError, InvalidRequestError
from ..index import blocks
from ..index.plan import ExtentRow, locate_blocks
from ..prefix import BlockKey
from ..storage import StorageError
from ..tokens import as_token_array
from .namespace_keys import NamespaceKeys

logger = logging.getLogger("tenantkv")


class NamespaceReads(NamespaceKeys):
    """Look up, prefetch and plan the loads of one namespace's cached prefixes; meter and
    record what loads served, and drop the extents they found damaged or lost."""

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
        with self._ctx.index.read_connection(serving=True) as connection:
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

    def cached_pages(self, pages: Sequence[Any]) -> list[bool]:
        """Per page (a one-block prefix keyed on its own, as :meth:`store_pages` stores them),
        whether it is cached now: one index read for the batch, where a :meth:`cached_length`
        per page is one each (SGLang's HiCache asks about a batch of pages at once). Not
        metered, like :meth:`cached_length`; failures degrade to every page missing.
        InvalidRequestError for a page that is not one block."""
        self._ctx.runtime.check_open()
        arrays = [as_token_array(page) for page in pages]
        for array in arrays:
            if len(array) != self.block_tokens:
                raise InvalidRequestError(
                    f"a page must be {self.block_tokens} tokens, got {len(array)}"
                )
        keys = [self._keys(array)[0] for array in arrays]
        if not keys:
            return []
        try:
            with self._ctx.index.read(serving=True) as session:
                present = blocks.present_keys(
                    session,
                    self.identity.namespace_id,
                    list(dict.fromkeys(keys)),
                    self._ctx.clock(),
                    stop_at_gap=False,
                )
        except SQLAlchemyError as err:
            return self._ctx.serving.degrade("cached_pages", err, [False] * len(keys))
        return [key in present for key in keys]

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

    # ---- prefetch and the plans of loads ---------------------------------------------------------

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
            with self._ctx.index.read_connection(serving=True) as connection:
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
        with self._ctx.index.read_connection(serving=True) as connection:
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
        # The codec is the namespace's: an extent whose header names another fails the header
        # check when the load opens it (an integrity failure), and its segments would not open.
        geometry = ExtentGeometry(
            row.num_blocks,
            row.num_layers,
            row.segment_bytes,
            CipherSuite(row.suite),
            codec=self.layout.coder.ident,
        )
        if geometry.num_layers != self.layout.num_layers or geometry.segment_bytes != (
            self.layout.segment_bytes(self.block_tokens)
        ):
            raise CacheMissError("an indexed extent does not match this namespace's layout")
        context = SegmentContext(
            self.identity.tenant_id, row.key_version, self.identity.namespace_id, geometry.codec
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
            # Bytes served are the decoded tensors the caller got (what the engine's memory
            # and the layer-by-layer stream carry), not the sealed bytes read from the store.
            self._meter(
                served_tokens=stream.num_tokens,
                served_bytes=delivered * stream.num_tokens * self.layout.token_bytes,
            )
        first, last = stream.first_layer_at, stream.last_handed_at
        # The metric counts the stored bytes the load read and decrypted (a codec's codes, what
        # the disk, the page cache and the link to a GPU carry); under codec none the same as
        # the decoded bytes.
        blocks = stream.num_tokens // self.block_tokens
        self._ctx.metrics.loaded(
            self.tenant,
            delivered * blocks * self.layout.segment_bytes(self.block_tokens),
            seconds=last - requested
            if last is not None and delivered == stream.num_layers
            else None,
            first_layer_seconds=None if first is None else first - requested,
        )
        self._ctx.uses.record(self.identity.tenant_id, extent_ids, started)

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
