"""The cache manager: opens the index, block store and keys; manages tenants and namespaces."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from . import tenants
from .audit import FAILURE, KEYS_RETIRE, ROLE_OPERATOR, Attribution, AuditLog
from .buffers import RecyclingPool
from .config import CacheConfig, block_store_path
from .coordination import (
    CoordinationThread,
    KeyEpochWatcher,
    LeaseKeeper,
    new_node_id,
)
from .crypto import (
    CipherSuite,
    KeyEncryptionKey,
    KeyWrapper,
    MasterKeyError,
    SealOpenError,
    default_master_key_provider,
    new_key,
)
from .errors import (
    CacheClosedError,
    InvalidRequestError,
    QuotaExceededError,
    TenantNotFoundError,
)
from .extent_removal import ExtentRemover
from .gc import BackgroundGc, GcReport, Progress
from .gc import collect as gc_collect
from .health import HealthCounters
from .index import capacity, counters, extents, leases
from .index.database import Database
from .index.schema import Block, DataKey, Extent, SchemaInfo, Tenant
from .index.schema import Namespace as NamespaceRow
from .keyring import Keyring
from .layout import KVLayout
from .loader import LoadStream
from .metering import Meter, UsageReport, read_usage
from .namespace import Namespace, NamespaceIdentity
from .prefix import model_fingerprint
from .quota import Evicted, total_quota
from .reseal import reseal_tenant
from .security_events import SecurityEvent, SecurityEventLog
from .serving import ServingPolicy
from .staging import RingStats, StagingRing
from .storage import BlockStore, LocalBlockStore
from .tenants import TenantInfo

logger = logging.getLogger("tenantkv")

_MAX_SCOPE = 256
_MAX_MODEL = 256
_CAPACITY = "capacity_bytes"
_OVERCOMMIT = "allow_overcommit"
_KEY_CHECK = "master_key_check"
_KEY_CHECK_CONTEXT = b"tenantkv/master-key-check"


def _check_label(what: str, value: Any, limit: int) -> str:
    if not isinstance(value, str) or not value or len(value) > limit or not value.isprintable():
        raise InvalidRequestError(f"{what} must be a printable string of 1-{limit} characters")
    return value


class TenantKV:
    """A tenantkv cache. Create with :func:`tenantkv.open`; close with :meth:`close` or ``with``."""

    def __init__(
        self,
        config: CacheConfig,
        *,
        database: Database,
        block_store: BlockStore,
        key_wrapper: KeyWrapper,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.root = config.root
        self.db = database
        self.store_backend = block_store
        self.keyring = Keyring(key_wrapper)
        self.suite = config.suite
        self.strict = config.strict
        self.clock = clock
        self.events = SecurityEventLog()
        self.health = HealthCounters()
        self.serving = ServingPolicy(config.strict, self.health)
        # Whom this process's own actions are recorded as (the admin service passes its callers).
        self.attribution = Attribution(
            f"python-api@{socket.gethostname()}:{os.getpid()}", ROLE_OPERATOR
        )
        self.log = logger
        self.meter = Meter()
        self.default_quota_bytes = config.default_quota_bytes
        self.hit_cost = config.hit_cost
        self.node_id = new_node_id()
        self.remover = ExtentRemover(database, block_store)
        self.leases = LeaseKeeper(
            database, self.remover, node_id=self.node_id, lease_seconds=config.lease_seconds
        )
        self._key_epoch = KeyEpochWatcher(database, self.keyring)
        self._coordination = CoordinationThread(self.leases, self._key_epoch)
        self._gc: BackgroundGc | None = None
        self.workers = config.seal_threads
        # Layers a load keeps ready ahead of its caller (and a store seals ahead of its writes):
        # the next layers arrive while the caller works on one, and memory stays bounded.
        self.window = config.read_ahead
        self.executor = ThreadPoolExecutor(self.workers, thread_name_prefix="tenantkv-seal")
        # Loads read and open chunks on their own pool, so a large store never delays a load's
        # first layer, and bookkeeping (recording block use) runs there in the background.
        self.load_threads = config.load_threads
        self.load_executor = ThreadPoolExecutor(
            self.load_threads, thread_name_prefix="tenantkv-load"
        )
        self._ring_config = (config.staging_bytes, config.staging_slot_bytes)
        self._rings = {False: StagingRing(*self._ring_config)}
        # Host memory for fresh CPU layers, recycled once callers drop them (see buffers.py).
        self.layer_pool = RecyclingPool(max_bytes=config.layer_pool_bytes)
        self._streams: weakref.WeakSet[LoadStream] = weakref.WeakSet()
        self._closed = False
        self._lock = threading.Lock()
        try:
            self.db.create_schema()
            self._check_master_key(key_wrapper)
            self.audit = AuditLog(key_wrapper, clock=clock)
            with self.db.write() as session:
                self.audit.ensure_signing_key(session)
            self._init_capacity()
            self._key_epoch.check()
        except BaseException:
            self.executor.shutdown(wait=False)
            self.load_executor.shutdown(wait=False)
            self.db.close()
            raise
        self._coordination.start()
        if config.gc_interval is not None:
            self.start_background_gc(config.gc_interval)

    def _check_master_key(self, wrapper: KeyWrapper) -> None:
        """Refuse a master key that is not the one this index was created with.

        The index keeps a random value wrapped by its master key; a wrong key (a lost or swapped
        key file, a wrong environment variable) fails here with a clear error instead of at the
        first namespace.
        """
        with self.db.write() as session:
            row = session.get(SchemaInfo, _KEY_CHECK)
            if row is None:
                blob = wrapper.wrap(new_key(), _KEY_CHECK_CONTEXT)
                session.add(SchemaInfo(name=_KEY_CHECK, value=blob.hex()))
                return
        try:
            wrapper.unwrap(bytes.fromhex(row.value), _KEY_CHECK_CONTEXT)
        except SealOpenError:
            raise MasterKeyError("the master key does not open this cache's index") from None

    def _init_capacity(self) -> None:
        """On the index's first open: the capacity is the size of the file system holding the
        root, without overcommit (recorded like any change of it)."""
        with self.db.write() as session:
            if capacity.read(session) is not None:
                return
            initial = capacity.Capacity(shutil.disk_usage(self.root).total, False)
            capacity.write(session, initial)
            self.audit.append(
                session,
                self.attribution.event(
                    None,
                    "capacity.update",
                    "store",
                    details={
                        "capacity_bytes": initial.capacity_bytes,
                        "allow_overcommit": initial.allow_overcommit,
                    },
                ),
            )

    @property
    def capacity_bytes(self) -> int:
        """The store's capacity, as the index holds it now (shared by every node)."""
        return self._capacity().capacity_bytes

    @property
    def allow_overcommit(self) -> bool:
        """Whether quotas may add up to more than the capacity (index state)."""
        return self._capacity().allow_overcommit

    def _capacity(self) -> capacity.Capacity:
        with self.db.read() as session:
            value = capacity.read(session)
        assert value is not None, "the capacity is set when the index is first opened"
        return value

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
        self.check_open()
        if capacity_bytes is not None:
            tenants.check_quota(capacity_bytes)
        if allow_overcommit is not None and not isinstance(allow_overcommit, bool):
            raise InvalidRequestError("allow_overcommit must be a boolean")
        with self.db.write() as session:
            stored = capacity.read(session)
            assert stored is not None, "the capacity is set when the index is first opened"
            new = capacity.Capacity(
                stored.capacity_bytes if capacity_bytes is None else capacity_bytes,
                stored.allow_overcommit if allow_overcommit is None else allow_overcommit,
            )
            if not new.allow_overcommit:
                reserved = total_quota(session)
                if reserved > new.capacity_bytes:
                    raise QuotaExceededError(
                        f"tenants reserve {reserved} bytes, more than a capacity of "
                        f"{new.capacity_bytes}; raise the capacity, lower quotas, or allow "
                        "overcommit"
                    )
            if new != stored:
                capacity.write(session, new)
                self.audit.append(
                    session,
                    (by or self.attribution).event(
                        None,
                        "capacity.update",
                        "store",
                        details={
                            "capacity_bytes": new.capacity_bytes,
                            "allow_overcommit": new.allow_overcommit,
                        },
                    ),
                )
        if new.allow_overcommit != stored.allow_overcommit:
            self.events.record(
                "overcommit_changed",
                "",
                f"quota overcommit {'allowed' if new.allow_overcommit else 'disallowed'} "
                "by the operator",
            )
        return {"capacity_bytes": new.capacity_bytes, "allow_overcommit": new.allow_overcommit}

    def record_security_event(self, kind: str, tenant: str, detail: str, action: str) -> None:
        """Log, count and audit a data-plane security event. Never raises: the serving path
        must not fail because the audit write did."""
        self.events.record(kind, tenant, detail)
        try:
            with self.db.write() as session:
                self.audit.append(
                    session,
                    self.attribution.event(
                        tenant or None, action, outcome=FAILURE, details={"detail": detail[:500]}
                    ),
                )
        except Exception as err:
            logger.error("could not audit security event %s: %s", kind, err)

    # ---- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams = list(self._streams)
        if self._gc is not None:
            self._gc.stop()
        for stream in streams:  # their chunks must finish before the pools go away
            stream.close()
        self._coordination.stop()
        try:
            self.meter.flush(self.db)
        except SQLAlchemyError as err:
            logger.warning("metering could not be saved at close: %s", err)
        self.load_executor.shutdown(wait=True, cancel_futures=True)
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.leases.release_all()  # loads whose bookkeeping the shutdown cancelled
        self.store_backend.close()
        self.db.close()

    def check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("the cache is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

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

        ``quota_bytes`` (default: the cache's ``default_quota_bytes``) is reserved out of the
        store's capacity; ``retention`` maps classes to durations (``{"agent": "3d"}``; classes
        not named keep the defaults agent 3d, chat 7d). A duplicate name raises
        TenantExistsError; a quota that does not fit the capacity raises QuotaExceededError.
        """
        self.check_open()
        return tenants.create_tenant(self, name, quota_bytes, retention, by or self.attribution)

    def update_tenant(
        self,
        name: str,
        *,
        quota_bytes: int | None = None,
        retention: Mapping[str, Any] | None = None,
        by: Attribution | None = None,
    ) -> TenantInfo:
        """Change quota and/or retention; a lower quota evicts the tenant's LRU extents now."""
        self.check_open()
        return tenants.update_tenant(self, name, quota_bytes, retention, by or self.attribution)

    def get_tenant(self, name: str) -> TenantInfo:
        self.check_open()
        return tenants.get_tenant(self, name)

    def list_tenants(self) -> list[TenantInfo]:
        self.check_open()
        return tenants.list_tenants(self)

    def delete_tenant(self, name: str, *, by: Attribution | None = None) -> None:
        """Crypto-shred a tenant: its keys and index rows go in one transaction, then its bytes."""
        self.check_open()
        tenants.delete_tenant(self, name, by or self.attribution)

    def rotate_keys(self, name: str, *, by: Attribution | None = None) -> int:
        """New writes of ``name`` use a new data-key version (returned); old ones stay readable."""
        self.check_open()
        return tenants.rotate_keys(self, name, by or self.attribution)

    def retire_keys(self, name: str, *, by: Attribution | None = None) -> dict[str, Any]:
        """Re-seal every extent sealed with an old key version under the current one, then
        destroy the old versions that nothing uses any more.

        Extents a running load is reading are skipped (their version is kept); run it again
        later to finish. Returns what was done.
        """
        self.check_open()
        with self.db.read() as session:
            row = session.scalar(select(Tenant).where(Tenant.name == name))
            if row is None:
                raise TenantNotFoundError(f"no tenant named {name!r}")
            tenant_id, current = row.id, row.current_key_version
        outcome = reseal_tenant(self, name, tenant_id, current)
        with self.db.write() as session:
            row = session.get(Tenant, tenant_id)
            if row is None:
                raise TenantNotFoundError(f"no tenant named {name!r}")
            retired = tenants.unused_old_versions(session, row)
            if retired:
                session.execute(
                    delete(DataKey).where(
                        DataKey.tenant_id == tenant_id, DataKey.version.in_(retired)
                    )
                )
            if retired:
                counters.bump(session, counters.KEY_EPOCH)  # other nodes drop the old keys
            remaining = tenants.count_extents_with_old_keys(session, row)
            result: dict[str, Any] = {
                "resealed": outcome.resealed,
                "dropped": outcome.dropped,
                "skipped_in_use": outcome.skipped_in_use,
                "retired_versions": sorted(retired),
                "extents_on_old_keys": remaining,
            }
            self.audit.append(
                session, (by or self.attribution).event(name, KEYS_RETIRE, name, details=result)
            )
        self.keyring.forget_versions(tenant_id, retired)
        return result

    def usage(
        self,
        name: str,
        *,
        since: float | None = None,
        until: float | None = None,
        scope: str | None = None,
    ) -> UsageReport:
        """Metering of ``name`` (one ``scope``, or all) for buckets starting in [since, until)."""
        self.check_open()
        self.meter.flush(self.db)
        with self.db.read() as session:
            tenant_id = session.scalar(select(Tenant.id).where(Tenant.name == name))
        if tenant_id is None:
            raise TenantNotFoundError(f"no tenant named {name!r}")
        counters = read_usage(self.db, tenant_id, scope, since, until)
        return UsageReport(name, scope, since, until, counters, self.hit_cost)

    def gc(self, *, orphan_grace: float = 600.0, progress: Progress | None = None) -> GcReport:
        """Remove expired extents (index first, bytes second) and orphaned files; flush metering."""
        self.check_open()
        return gc_collect(self, orphan_grace=orphan_grace, progress=progress)

    # ---- namespaces ---------------------------------------------------------------------------

    def namespace(
        self,
        tenant: str,
        *,
        model: str,
        layout: KVLayout,
        scope: str | None = None,
        revision: str | None = None,
    ) -> Namespace:
        """The namespace of ``tenant`` (and ``scope``) for a model and layout; made on first use."""
        self.check_open()
        tenants.check_tenant_name(tenant)
        _check_label("model", model, _MAX_MODEL)
        if scope is not None:
            _check_label("scope", scope, _MAX_SCOPE)
        if revision is not None:
            _check_label("revision", revision, _MAX_MODEL)
        if not isinstance(layout, KVLayout):
            raise InvalidRequestError("layout must be a tenantkv.KVLayout")
        fingerprint = model_fingerprint(model, revision, layout.describe())
        scope_value = scope or ""
        for _attempt in range(2):
            with self.db.read() as session:
                tenant_id = session.scalar(select(Tenant.id).where(Tenant.name == tenant))
                if tenant_id is None:
                    raise TenantNotFoundError(f"no tenant named {tenant!r}")
                row = session.scalar(
                    select(NamespaceRow).where(
                        NamespaceRow.tenant_id == tenant_id,
                        NamespaceRow.scope == scope_value,
                        NamespaceRow.fingerprint == fingerprint.hex(),
                    )
                )
            if row is None:
                row = self._create_namespace(tenant_id, scope_value, model, fingerprint.hex())
                if row is None:
                    continue  # lost a creation race; read the winner's row
            hash_key = self.keyring.namespace_key(tenant_id, row.id, row.wrapped_hash_key)
            identity = NamespaceIdentity(row.id, tenant_id, tenant, scope, model, fingerprint)
            return Namespace(self, identity, layout, hash_key)
        raise RuntimeError("namespace creation did not converge")  # pragma: no cover

    def _create_namespace(
        self, tenant_id: bytes, scope: str, model: str, fingerprint: str
    ) -> NamespaceRow | None:
        namespace_id = secrets.token_bytes(16)
        wrapped = self.keyring.new_namespace_key(tenant_id, namespace_id)
        row = NamespaceRow(
            id=namespace_id,
            tenant_id=tenant_id,
            scope=scope,
            model=model,
            fingerprint=fingerprint,
            wrapped_hash_key=wrapped,
            created_at=self.clock(),
        )
        try:
            with self.db.write() as session:
                session.add(row)
        except IntegrityError:
            return None
        return row

    # ---- maintenance --------------------------------------------------------------------------

    def start_background_gc(self, interval: float) -> None:
        """Collect garbage every ``interval`` seconds until :meth:`close` (idempotent)."""
        self.check_open()
        if interval <= 0:
            raise InvalidRequestError("the GC interval must be positive")
        with self._lock:
            if self._gc is None:
                self._gc = BackgroundGc(self, interval)
                self._gc.start()

    def leased_extents(self) -> set[str]:
        """Extents some node's running load holds a lease on (eviction, GC, re-sealing and
        purges pass them over; their bytes stay until the lease ends)."""
        with self.db.read() as session:
            return leases.leased(session, None, time.time())

    def discard_evicted(self, tenant_id: bytes, evicted: list[Evicted]) -> None:
        """After an eviction committed: remove the bytes and meter it."""
        if not evicted:
            return
        now = self.clock()
        scopes = self._scopes_of({e.namespace_id for e in evicted})
        self.remover.remove_bytes([item.extent_id for item in evicted])
        for item in evicted:
            scope = scopes.get(item.namespace_id, "")
            if item.expired:
                self.meter.add(
                    tenant_id, scope, now, expired_extents=1, expired_bytes=item.size_bytes
                )
            else:
                self.meter.add(
                    tenant_id, scope, now, evicted_extents=1, evicted_bytes=item.size_bytes
                )

    def _scopes_of(self, namespace_ids: set[bytes]) -> dict[bytes, str]:
        with self.db.read() as session:
            rows = session.execute(
                select(NamespaceRow.id, NamespaceRow.scope).where(
                    NamespaceRow.id.in_(namespace_ids)
                )
            )
            return {namespace_id: scope for namespace_id, scope in rows}

    def delete_extent_file(self, extent_id: str) -> bool:
        """Remove an extent's bytes (its index rows are already gone); failures are left to the
        orphan sweep."""
        return self.remover.delete_file(extent_id)

    def drop_extent(self, extent_id: str) -> None:
        """Remove a damaged extent from the index (first) and the block store (second).

        Its bytes go at once even if loads hold leases on them: they fail to open for every
        reader alike, so there is nothing left to protect."""
        with self.db.write() as session:
            extents.delete_rows(session, [extent_id])
        self.remover.delete_file(extent_id)

    def staging_ring(self, *, pinned: bool) -> StagingRing:
        """The ring shared by all loads (a pinned one, made on first use, for CUDA targets)."""
        with self._lock:
            ring = self._rings.get(pinned)
            if ring is None:
                ring = self._rings[pinned] = StagingRing(*self._ring_config, pinned=pinned)
            return ring

    def staging_stats(self) -> dict[str, RingStats]:
        """Slots, slots in use, peak use and back-pressure waits of each staging ring."""
        with self._lock:
            rings = dict(self._rings)
        return {("pinned" if pinned else "host"): ring.stats() for pinned, ring in rings.items()}

    def submit_background(self, task: Callable[..., object], *args: object) -> None:
        """Run bookkeeping on the reader pool; dropped (never raised) once the cache closes."""
        with contextlib.suppress(RuntimeError):
            self.load_executor.submit(task, *args)

    def track_stream(self, stream: LoadStream) -> None:
        with self._lock:
            self._streams.add(stream)

    def suite_of(self, value: int) -> CipherSuite:
        return CipherSuite(value)

    def security_events(self) -> dict[str, int]:
        """Counts of security events recorded by this process, by kind."""
        return self.events.counts()

    def health_counters(self) -> dict[str, int]:
        """Counts of what went wrong in this process that is not a security event: lost
        extents (bytes gone or short: a miss) and operations degraded to a miss because the
        index or block store failed (``degraded_lookup``, ``degraded_store``, ...)."""
        return self.health.counts()

    def recent_security_events(self) -> list[SecurityEvent]:
        return self.events.recent()

    def info(self) -> dict[str, Any]:
        """A summary for operators: where things live and how much is cached."""
        self.check_open()
        with self.db.read() as session:
            tenants = session.scalar(select(func.count()).select_from(Tenant)) or 0
            namespaces = session.scalar(select(func.count()).select_from(NamespaceRow)) or 0
            extents = session.scalar(select(func.count()).select_from(Extent)) or 0
            blocks = session.scalar(select(func.count()).select_from(Block)) or 0
            stored_bytes = (
                session.scalar(
                    select(
                        func.coalesce(
                            func.sum(Extent.num_blocks * Extent.num_layers * Extent.segment_bytes),
                            0,
                        )
                    )
                )
                or 0
            )
        return {
            "root": str(self.root),
            "database": self.db.engine.url.render_as_string(hide_password=True),
            "schema_version": self.db.schema_version(),
            "cipher_suite": self.suite.name,
            "tenants": int(tenants),
            "namespaces": int(namespaces),
            "extents": int(extents),
            "blocks": int(blocks),
            "cached_tokens": int(blocks) * 64,
            "stored_bytes": int(stored_bytes),
            "capacity_bytes": self.capacity_bytes,
            "allow_overcommit": self.allow_overcommit,
            "workers": self.workers,
            "load_threads": self.load_threads,
            "staging_bytes": self._ring_config[0],
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
    **settings: Any,
) -> TenantKV:
    """Open (creating if needed) a cache rooted at a directory, or as a :class:`CacheConfig`
    says; ``settings`` override fields of the config (see :mod:`tenantkv.config` for every
    setting and its default).

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
    config.root.mkdir(parents=True, exist_ok=True)
    wrapper: KeyWrapper
    if config.master_key is None:
        wrapper = KeyEncryptionKey(default_master_key_provider(config.root / "master.key").load())
    elif isinstance(config.master_key, KeyWrapper):
        wrapper = config.master_key
    else:
        wrapper = KeyEncryptionKey(config.master_key.load())
    store = block_store or LocalBlockStore(
        block_store_path(config.blocks_url), durable=config.durable
    )
    kv = TenantKV(
        config,
        database=Database(config.index_url),
        block_store=store,
        key_wrapper=wrapper,
        clock=clock,
    )
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
