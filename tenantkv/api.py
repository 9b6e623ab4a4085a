"""The public face of a cache: :func:`open` and the thin :class:`TenantKV` facade.

``open`` builds the components once (``tenantkv.components.context``) and the facade hands
each call to the service that does it (``tenantkv.services``). The facade holds no logic of its
own beyond the order of closing. The admin API's tokens, the inference keys and the audit log
are service objects (:attr:`TenantKV.tokens`, :attr:`TenantKV.inference_keys`,
:attr:`TenantKV.audit`), so edges (the admin service, the CLI, the gateway) reach them without
the components; :attr:`TenantKV.context` is for tests and embedders that need a
component itself.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from sqlalchemy.exc import SQLAlchemyError

from .audit import Attribution
from .components.context import CacheContext, build_context
from .components.coordination import CoordinationThread
from .components.metering import UsageReport
from .config import CacheConfig, open_blocks, open_key_wrapper
from .crypto import KeyWrapper
from .datapath.staging import RingStats
from .errors import CacheUnavailableError, InvalidRequestError
from .index import stats
from .index.database import Database
from .index.failures import describe, shown_url, typed_failures, unavailable
from .layout import KVLayout
from .private_files import private_dir
from .security_events import SecurityEvent
from .services import capacity, purge, reseal, tenants
from .services.audit import AuditService
from .services.gc import BackgroundGc, GcReport, Progress
from .services.gc import collect as gc_collect
from .services.health import HealthReport, check_health
from .services.inference_keys import InferenceKeyService
from .services.jobs import JobService
from .services.namespace import Namespace, open_namespace
from .services.opening import FirstOpening, check_root, holds_cache, not_found
from .services.purge import PurgeReport
from .services.setup import prepare_index
from .services.tenants import TenantIncarnation, TenantInfo
from .services.tokens import TokenService
from .storage import BlockStore, StorageError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

logger = logging.getLogger("tenantkv")


@typed_failures
class TenantKV:
    """A tenantkv cache. Create with :func:`tenantkv.open`; close with :meth:`close` or ``with``.

    Every public method raises CacheUnavailableError, never a driver's or the block store's
    error, when the index or block store fails (``typed_failures``); on PostgreSQL within the
    config's ``index_admin_timeout`` (``index_serving_timeout`` for a namespace's serving
    calls)."""

    def __init__(self, context: CacheContext, key_wrapper: KeyWrapper) -> None:
        self._ctx = context
        self._tokens = TokenService(context)
        self._audit = AuditService(context)
        self._inference_keys = InferenceKeyService(context)
        self._jobs = JobService(context)
        self._gc: BackgroundGc | None = None
        self._lock = threading.Lock()
        self._coordination = CoordinationThread(context.leases, context.key_epoch)
        try:
            prepare_index(context, key_wrapper)
        except BaseException as err:
            context.runtime.shutdown(wait=False)
            context.blocks.close()
            context.index.close()
            if isinstance(err, SQLAlchemyError):  # unreachable, timed out, refused
                # The operator's own URL (password hidden), without the driver's name: the
                # CLI prints this as its one sentence.
                url = shown_url(context.index.engine.url)
                raise CacheUnavailableError(
                    f"opening the index at {url} failed: {describe(err)}"
                ) from err
            raise
        self._coordination.start()
        if context.config.gc_interval is not None:
            self.start_background_gc(context.config.gc_interval)

    @property
    def context(self) -> CacheContext:
        """The cache's components, for tests and embedders that need one of them."""
        return self._ctx

    @property
    def config(self) -> CacheConfig:
        return self._ctx.config

    @property
    def tokens(self) -> TokenService:
        """The admin API's tokens: mint, list, revoke, authenticate (``services/tokens.py``)."""
        return self._tokens

    @property
    def inference_keys(self) -> InferenceKeyService:
        """Keys of inference traffic: mint, list, revoke, authenticate
        (``services/inference_keys.py``)."""
        return self._inference_keys

    @property
    def jobs(self) -> JobService:
        """Long operations (retirement, purge, deletion, GC) as jobs with progress, kept in the
        index (``services/jobs.py``)."""
        return self._jobs

    @property
    def audit(self) -> AuditService:
        """The audit log: exports, checkpoints, the public key (``services/audit.py``)."""
        return self._audit

    def now(self) -> float:
        """The cache's clock (what its records, expiries and retention are timed by)."""
        return self._ctx.clock()

    # ---- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Close open streams, stop background work, flush metering, give back leases."""
        runtime = self._ctx.runtime
        if runtime.closed:
            return
        streams = runtime.begin_close()
        if self._gc is not None:
            self._gc.stop()
        for stream in streams:  # their chunks must finish before the pools go away
            stream.close()
        self._coordination.stop()
        self._inference_keys.close()  # use counts not yet written
        try:
            self._ctx.meter.flush(self._ctx.index)
        except SQLAlchemyError as err:
            logger.warning("metering could not be saved at close: %s", err)
        runtime.shutdown()
        self._ctx.uses.flush()  # records of use whose batch the shutdown cancelled
        self._ctx.leases.release_all()  # loads whose bookkeeping the shutdown cancelled
        self._ctx.incidents.close()  # refused requests still counted, not yet audited
        self._ctx.blocks.close()
        self._ctx.index.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (a liveness answer: touches nothing else)."""
        return self._ctx.runtime.closed

    def _open(self) -> CacheContext:
        self._ctx.runtime.check_open()
        return self._ctx

    # ---- tenants ------------------------------------------------------------------------------

    def create_tenant(
        self,
        name: str,
        *,
        quota_bytes: int | None = None,
        retention: Mapping[str, Any] | None = None,
        by: Attribution | None = None,
    ) -> TenantInfo:
        """Create a tenant with a fresh data key.

        ``quota_bytes`` (default: the config's ``default_quota_bytes``) is reserved out of the
        store's capacity; ``retention`` maps classes to durations (``{"agent": "3d"}``; classes
        not named keep the defaults agent 3d, chat 7d). A duplicate name raises
        TenantExistsError; a quota that does not fit the capacity raises QuotaExceededError.
        """
        ctx = self._open()
        return tenants.create_tenant(ctx, name, quota_bytes, retention, by or ctx.attribution)

    def update_tenant(
        self,
        name: str,
        *,
        quota_bytes: int | None = None,
        retention: Mapping[str, Any] | None = None,
        by: Attribution | None = None,
    ) -> TenantInfo:
        """Change quota and/or retention. A lower quota evicts the tenant's LRU extents now,
        a running load's extent last: it leaves the index, its bytes stay until the load ends."""
        ctx = self._open()
        return tenants.update_tenant(ctx, name, quota_bytes, retention, by or ctx.attribution)

    def get_tenant(self, name: str) -> TenantInfo:
        return tenants.get_tenant(self._open(), name)

    def tenant_incarnation(self, name: str) -> TenantIncarnation | None:
        """Which tenant holds ``name`` now (its incarnation id and creation time), or None; what
        engines check a tenant assertion against, so that one issued to a deleted tenant does
        not open the cache of the next tenant of its name."""
        return tenants.current_incarnation(self._open(), name)

    def list_tenants(self) -> list[TenantInfo]:
        return tenants.list_tenants(self._open())

    def delete_tenant(
        self, name: str, *, by: Attribution | None = None, progress: Progress | None = None
    ) -> None:
        """Crypto-shred a tenant: its keys and index rows go in one transaction, then its bytes.

        Its running loads end before their next layer (``LoadRevokedError``). The index's files
        are scrubbed of the destroyed keys; when a reader's snapshot prevents that, it is logged
        and shown in ``health_counters()`` (``scrub_pending``) until a GC run finishes it."""
        ctx = self._open()
        tenants.delete_tenant(ctx, name, by or ctx.attribution, progress)

    def rotate_keys(self, name: str, *, by: Attribution | None = None) -> int:
        """New writes of ``name`` use a new data-key version (returned); old ones stay readable."""
        ctx = self._open()
        return tenants.rotate_keys(ctx, name, by or ctx.attribution)

    def retire_keys(
        self, name: str, *, by: Attribution | None = None, progress: Progress | None = None
    ) -> dict[str, Any]:
        """Re-seal every extent sealed with an old key version under the current one, then
        destroy the old versions that nothing uses any more.

        Extents a running load (on any node) is reading are skipped (their version is kept);
        run it again later to finish. Returns what was done; ``scrub_complete`` is False when
        the destroyed keys may still be in the index's files (see ``delete_tenant``).
        """
        ctx = self._open()
        return reseal.retire_keys(ctx, name, by or ctx.attribution, progress)

    def purge(
        self,
        name: str,
        *,
        scope: str | None = None,
        by: Attribution | None = None,
        progress: Progress | None = None,
    ) -> PurgeReport:
        """Remove every cached prefix of ``name`` (of ``scope`` only, if given), keeping the
        tenant and its keys; extents a running load reads are skipped and counted.
        ``progress(done, total)`` follows the removal of the files."""
        ctx = self._open()
        return purge.purge(ctx, by or ctx.attribution, name, scope, progress)

    def usage(
        self,
        name: str,
        *,
        since: float | None = None,
        until: float | None = None,
        scope: str | None = None,
    ) -> UsageReport:
        """Metering of ``name`` (one ``scope``, or all) for buckets starting in [since, until).

        A window shorter than the metering resolution (60-second buckets) is refused with
        InvalidRequestError: it would hold no bucket and read as zeros."""
        return tenants.usage(self._open(), name, scope, since, until)

    def usage_of_all(
        self, *, since: float | None = None, until: float | None = None
    ) -> list[UsageReport]:
        """Every tenant's metering over one window (by name; unused tenants at zero), with
        the same window rules as :meth:`usage`."""
        return tenants.usage_of_all(self._open(), since, until)

    # ---- the store ----------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        """The store's capacity, as the index holds it now (shared by every node)."""
        return capacity.read_capacity(self._ctx).capacity_bytes

    @property
    def allow_overcommit(self) -> bool:
        """Whether quotas may add up to more than the capacity (index state)."""
        return capacity.read_capacity(self._ctx).allow_overcommit

    def set_capacity(
        self,
        *,
        capacity_bytes: int | None = None,
        allow_overcommit: bool | None = None,
        by: Attribution | None = None,
    ) -> dict[str, Any]:
        """Change the store's capacity and/or overcommit policy for every node (audited; a
        change of overcommit is also a security event: it weakens isolation).

        Without overcommit the sum of tenant quotas must fit the capacity, or this raises
        QuotaExceededError and changes nothing. Returns the new values.
        """
        ctx = self._open()
        return capacity.set_capacity(ctx, capacity_bytes, allow_overcommit, by or ctx.attribution)

    def gc(
        self, *, orphan_grace: float | None = None, progress: Progress | None = None
    ) -> GcReport:
        """Remove expired extents (index first, bytes second) and orphaned files; flush metering.

        ``orphan_grace`` defaults to the config's (10 minutes)."""
        ctx = self._open()
        grace = ctx.config.orphan_grace if orphan_grace is None else orphan_grace
        try:
            return gc_collect(ctx, orphan_grace=grace, progress=progress)
        except StorageError as err:  # listing the block store failed
            raise unavailable("gc", err) from err

    def start_background_gc(self, interval: float) -> None:
        """Collect garbage every ``interval`` seconds until :meth:`close` (idempotent)."""
        ctx = self._open()
        if interval <= 0:
            raise InvalidRequestError("the GC interval must be positive")
        with self._lock:
            if self._gc is None:
                self._gc = BackgroundGc(ctx, interval)
                self._gc.start()

    # ---- namespaces ---------------------------------------------------------------------------

    def namespace(
        self,
        tenant: str,
        *,
        model: str,
        layout: KVLayout,
        scope: str | None = None,
        revision: str | None = None,
        block_tokens: int = 64,
        codec: str | None = None,
    ) -> Namespace:
        """The namespace of ``tenant`` (and ``scope``) for a model and layout; made on first use.

        ``block_tokens`` (a multiple of 16 up to 1024; default 64) is the namespace's block
        size: prefixes are keyed, looked up, stored and loaded in whole blocks of it. It is part
        of the namespace's identity, so the same model with another block size is another
        namespace.

        ``codec`` is how its values are stored (``tenantkv.codecs``): ``"none"`` (the values'
        own bytes, byte-exact), ``"fp8"`` (e4m3, about half the bytes) or ``"int4"``
        (Hadamard-rotated 4-bit codes, about a third); both lossy codecs are lossy, and they
        refuse non-finite values. ``None`` keeps the layout's (``"none"`` unless the layout was
        made with :meth:`KVLayout.with_codec`). The codec is part of the namespace's identity,
        so a namespace never serves another codec's blocks; loads return the layout's dtype."""
        return open_namespace(
            self._open(),
            tenant,
            model=model,
            layout=layout,
            scope=scope,
            revision=revision,
            block_tokens=block_tokens,
            codec=codec,
        )

    # ---- observing ----------------------------------------------------------------------------

    def leased_extents(self) -> set[str]:
        """Extents some node's running load holds a lease on (eviction, GC, re-sealing and
        purges pass them over; their bytes stay until the lease ends)."""
        with self._ctx.index.read() as session:
            return self._ctx.leases.held(session, None)

    def staging_stats(self) -> dict[str, RingStats]:
        """Slots, slots in use, peak use and back-pressure waits of each staging ring."""
        return self._ctx.runtime.staging_stats()

    def security_events(self) -> dict[str, int]:
        """Counts of security events recorded by this process, by kind."""
        return self._ctx.incidents.log.counts()

    def recent_security_events(self) -> list[SecurityEvent]:
        return self._ctx.incidents.log.recent()

    def check_available(self) -> None:
        """Raise CacheClosedError once closed, CacheUnavailableError when the index does not
        answer (a health check: it reads the schema revision, nothing of any tenant)."""
        ctx = self._open()
        try:
            ctx.index.schema_version()
        except SQLAlchemyError as err:
            # No driver text: the admin API's health answer shows it to clients (logged instead).
            raise unavailable("the health check", err) from err

    def health(self) -> HealthReport:
        """Whether this cache can serve, for a readiness probe of the server that embeds it:
        the index answers, its schema is the one this tenantkv needs, and the block store takes
        a write (a small probe extent, deleted again). Never raises for a failed check: see
        ``report.ready`` and ``report.checks`` (``"ok"`` or what failed; the cause is logged).
        Names no tenant. Costs one index read and one small write, so ask it every few
        seconds, not per request."""
        return check_health(self._open())

    def health_counters(self) -> dict[str, int]:
        """Counts of what went wrong in this process that is not a security event: lost
        extents (bytes gone or short: a miss) and operations degraded to a miss because the
        index or block store failed (``degraded_lookup``, ``degraded_store``, ...)."""
        return self._ctx.health.counts()

    @property
    def metrics_registry(self) -> CollectorRegistry | None:
        """This cache's data-plane metrics, for the embedding process to expose, e.g.
        ``prometheus_client.generate_latest(kv.metrics_registry)`` (docs/architecture.md,
        Metrics). Its own registry, not the process-wide default one; None when the
        ``metrics`` extra (``prometheus_client``) is not installed."""
        return self._ctx.metrics.registry

    def info(self) -> dict[str, Any]:
        """A summary for operators: where things live and how much is cached."""
        ctx = self._open()
        with ctx.index.read() as session:
            counts = stats.counts(session)
        store = capacity.read_capacity(ctx)
        return {
            "root": str(ctx.config.root),
            "database": ctx.index.engine.url.render_as_string(hide_password=True),
            "schema_version": ctx.index.schema_version(),
            "cipher_suite": ctx.config.suite.name,
            "tenants": counts["tenants"],
            "namespaces": counts["namespaces"],
            "extents": counts["extents"],
            "blocks": counts["blocks"],
            "cached_tokens": counts["blocks"] * 64,
            "stored_bytes": counts["stored_bytes"],
            "capacity_bytes": store.capacity_bytes,
            "allow_overcommit": store.allow_overcommit,
            "workers": ctx.runtime.workers,
            "load_threads": ctx.runtime.load_threads,
            "staging_bytes": ctx.runtime.staging_bytes,
            "node_id": ctx.leases.node_id,
        }


def open(
    root_or_config: str | os.PathLike[str] | CacheConfig,
    /,
    *,
    block_store: BlockStore | None = None,
    clock: Callable[[], float] = time.time,
    capacity_bytes: int | None = None,
    allow_overcommit: bool | None = None,
    workers: int | None = None,
    load_threads: int | None = None,
    create: bool = True,
    **settings: Any,
) -> TenantKV:
    """Open (creating if needed) a cache rooted at a directory, or as a :class:`CacheConfig`
    says; ``settings`` override fields of the config (see :mod:`tenantkv.config` for every
    setting and its default).

    ``create=False`` opens an existing cache only: a root whose index holds none (a mistyped
    path) raises CacheNotFoundError and nothing is created, not even the root directory. The
    CLI opens that way everywhere but ``init`` and the demos. With ``create=True`` (the
    default, for embedders and tests that open fresh roots), an opening that fails before the
    cache exists removes what it created (``services/opening.py``); an existing index never
    gets a new key file (a missing one is a MasterKeyError).

    Defaults are the embedded setup: SQLite index ``<root>/index.db`` (WAL), extents under
    ``<root>/blocks``, master key from ``TENANTKV_MASTER_KEY`` or the key file
    ``<root>/master.key`` (created 0600 on first use). ``strict=True`` raises
    CacheUnavailableError where the serving path would otherwise degrade to a miss.

    ``block_store`` (an instance) replaces the one ``block_store_url`` names; ``clock`` is
    injectable for tests (leases always use the wall clock, since every node must agree on
    them). ``workers`` and ``load_threads`` are the older names of ``seal_workers`` and
    ``load_workers``.

    ``capacity_bytes`` and ``allow_overcommit`` are deprecated here: the capacity is index
    state shared by every node; change it with :meth:`TenantKV.set_capacity` (audited). Given
    here, they are applied the same way, once the cache is open.
    """
    config = (
        root_or_config
        if isinstance(root_or_config, CacheConfig)
        else CacheConfig(root=Path(root_or_config))
    )
    if workers is not None:
        settings.setdefault("seal_workers", workers)
    if load_threads is not None:
        settings.setdefault("load_workers", load_threads)
    config = config.with_overrides(**settings)
    check_root(config.root)
    existing = holds_cache(config)  # creates nothing, not even the root
    if not existing and not create:
        raise not_found(config)
    first = None if existing else FirstOpening(config)
    try:
        try:
            private_dir(config.root)  # 0700; a root others can read is fixed, with a warning
        except OSError as err:  # read-only file system, no permission: a sentence, no trace
            raise InvalidRequestError(
                f"the cache root {config.root} cannot be used: {err.strerror or err}"
            ) from err
        wrapper = open_key_wrapper(config, create_key_file=not existing)
        store = block_store or open_blocks(config)
        index = Database(
            config.index_url,
            serving_timeout=config.index_serving_timeout,
            admin_timeout=config.index_admin_timeout,
        )
        context = build_context(config, index=index, blocks=store, key_wrapper=wrapper, clock=clock)
        kv = TenantKV(context, wrapper)  # closes what it was given if it fails
    except BaseException:
        if first is not None:
            first.undo()
        raise
    if capacity_bytes is not None or allow_overcommit is not None:
        warnings.warn(
            "open(capacity_bytes=, allow_overcommit=) is deprecated: the capacity is index "
            "state shared by every node; call TenantKV.set_capacity() (audited)",
            DeprecationWarning,
            stacklevel=2,
        )
        try:
            kv.set_capacity(capacity_bytes=capacity_bytes, allow_overcommit=allow_overcommit)
        except BaseException:
            kv.close()
            raise
    return kv
