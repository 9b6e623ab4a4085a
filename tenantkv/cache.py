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
import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from . import config, tenants
from .audit import FAILURE, KEYS_RETIRE, ROLE_OPERATOR, Attribution, AuditLog
from .buffers import RecyclingPool
from .crypto import (
    DEFAULT_SUITE,
    CipherSuite,
    KeyEncryptionKey,
    KeyWrapper,
    MasterKeyError,
    MasterKeyProvider,
    SealOpenError,
    default_master_key_provider,
    new_key,
)
from .database import Database
from .errors import (
    CacheClosedError,
    InvalidRequestError,
    QuotaExceededError,
    TenantNotFoundError,
)
from .gc import BackgroundGc, GcReport, Progress
from .gc import collect as gc_collect
from .layout import KVLayout
from .loader import LoadStream
from .metering import DEFAULT_HIT_COST, Meter, UsageReport, read_usage
from .models import Block, DataKey, Extent, SchemaInfo, Tenant
from .models import Namespace as NamespaceRow
from .namespace import Namespace, NamespaceIdentity
from .prefix import model_fingerprint
from .quota import Evicted, lock_tenants, total_quota
from .reseal import reseal_tenant
from .security_events import SecurityEvent, SecurityEventLog
from .staging import DEFAULT_RING_BYTES, DEFAULT_SLOT_BYTES, RingStats, StagingRing
from .storage import BlockStore, LocalBlockStore, StorageError
from .tenants import TenantInfo

logger = logging.getLogger("tenantkv")

_MAX_SCOPE = 256
_MAX_MODEL = 256
_CAPACITY = tenants.CAPACITY_ROW
_OVERCOMMIT = "allow_overcommit"
DEFAULT_QUOTA_BYTES = 2**30
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
        *,
        root: Path,
        database: Database,
        block_store: BlockStore,
        key_wrapper: KeyWrapper,
        suite: CipherSuite = DEFAULT_SUITE,
        strict: bool = False,
        workers: int | None = None,
        load_threads: int | None = None,
        window: int | None = None,
        staging_bytes: int = DEFAULT_RING_BYTES,
        staging_slot_bytes: int = DEFAULT_SLOT_BYTES,
        capacity_bytes: int | None = None,
        allow_overcommit: bool | None = None,
        default_quota_bytes: int = DEFAULT_QUOTA_BYTES,
        hit_cost: float = DEFAULT_HIT_COST,
        gc_interval: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from .keyring import Keyring

        self.root = root
        self.db = database
        self.store_backend = block_store
        self.keyring = Keyring(key_wrapper)
        self.suite = suite
        self.strict = strict
        self.clock = clock
        self.events = SecurityEventLog()
        # Whom this process's own actions are recorded as (the admin service passes its callers).
        self.attribution = Attribution(
            f"python-api@{socket.gethostname()}:{os.getpid()}", ROLE_OPERATOR
        )
        self.log = logger
        self.meter = Meter()
        self.default_quota_bytes = default_quota_bytes
        self.hit_cost = hit_cost
        self._pins: Counter[str] = Counter()
        self._pins_lock = threading.Lock()
        self._gc: BackgroundGc | None = None
        self.workers = workers or os.cpu_count() or 1
        # Layers a load keeps ready ahead of its caller (and a store seals ahead of its writes):
        # the next layers arrive while the caller works on one, and memory stays bounded.
        self.window = window or max(2, self.workers)
        self.executor = ThreadPoolExecutor(self.workers, thread_name_prefix="tenantkv-seal")
        # Loads read and open chunks on their own pool, so a large store never delays a load's
        # first layer, and bookkeeping (recording block use) runs there in the background.
        self.load_threads = load_threads or max(2, self.workers)
        self.load_executor = ThreadPoolExecutor(
            self.load_threads, thread_name_prefix="tenantkv-load"
        )
        self._rings = {
            False: StagingRing(staging_bytes, staging_slot_bytes),
        }
        self._ring_config = (staging_bytes, staging_slot_bytes)
        # Host memory for fresh CPU layers, recycled once callers drop them (see buffers.py).
        self.layer_pool = RecyclingPool(max_bytes=256 * 2**20)
        self._streams: weakref.WeakSet[LoadStream] = weakref.WeakSet()
        self._closed = False
        self._lock = threading.Lock()
        try:
            with self.db.opening():
                self.db.create_schema()
                self._check_master_key(key_wrapper)
                self.audit = AuditLog(key_wrapper, clock=clock)
                with self.db.write() as session:
                    self.audit.ensure_signing_key(session)
                self.capacity_bytes, self.allow_overcommit = self._settle_capacity(
                    capacity_bytes, allow_overcommit
                )
        except BaseException:
            self.executor.shutdown(wait=False)
            self.load_executor.shutdown(wait=False)
            self.db.close()
            raise
        if gc_interval is not None:
            self.start_background_gc(gc_interval)

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

    def _settle_capacity(
        self, capacity_bytes: int | None, allow_overcommit: bool | None
    ) -> tuple[int, bool]:
        """The store's capacity and overcommit policy: given values are persisted (a change of
        policy is recorded as a security event), otherwise the stored ones (or the defaults:
        the size of the file system holding the root, no overcommit) apply."""
        with self.db.write() as session:
            # Locked like every quota change (see tenants._check_capacity).
            stored_capacity = session.get(SchemaInfo, _CAPACITY, with_for_update=True)
            stored_overcommit = session.get(SchemaInfo, _OVERCOMMIT)
            if capacity_bytes is None:
                capacity = (
                    int(stored_capacity.value)
                    if stored_capacity is not None
                    else shutil.disk_usage(self.root).total
                )
            else:
                capacity = tenants.check_quota(capacity_bytes)
            overcommit = (
                stored_overcommit is not None and stored_overcommit.value == "1"
                if allow_overcommit is None
                else bool(allow_overcommit)
            )
            if not overcommit:
                reserved = total_quota(session)
                if reserved > capacity:
                    raise QuotaExceededError(
                        f"tenants reserve {reserved} bytes, more than a capacity of {capacity}; "
                        "raise the capacity, lower quotas, or allow overcommit"
                    )
            previous_capacity = int(stored_capacity.value) if stored_capacity is not None else None
            session.merge(SchemaInfo(name=_CAPACITY, value=str(capacity)))
            previous = stored_overcommit.value == "1" if stored_overcommit is not None else False
            session.merge(SchemaInfo(name=_OVERCOMMIT, value="1" if overcommit else "0"))
            if overcommit != previous or capacity != previous_capacity:
                self.audit.append(
                    session,
                    self.attribution.event(
                        None,
                        "capacity.update",
                        "store",
                        details={"capacity_bytes": capacity, "allow_overcommit": overcommit},
                    ),
                )
        if overcommit != previous:
            self.events.record(
                "overcommit_changed",
                "",
                f"quota overcommit {'allowed' if overcommit else 'disallowed'} by the operator",
            )
        return capacity, overcommit

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
        try:
            self.meter.flush(self.db)
        except SQLAlchemyError as err:
            logger.warning("metering could not be saved at close: %s", err)
        self.load_executor.shutdown(wait=True, cancel_futures=True)
        self.executor.shutdown(wait=True, cancel_futures=True)
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

    def pin_extents(self, extent_ids: list[str]) -> None:
        """Mark extents as read by a running load: eviction and GC leave them alone."""
        with self._pins_lock:
            self._pins.update(extent_ids)

    def unpin_extents(self, extent_ids: list[str]) -> None:
        with self._pins_lock:
            self._pins.subtract(extent_ids)
            for extent_id in extent_ids:
                if self._pins[extent_id] <= 0:
                    del self._pins[extent_id]

    def pinned_extents(self) -> set[str]:
        with self._pins_lock:
            return set(self._pins)

    def discard_evicted(self, tenant_id: bytes, evicted: list[Evicted]) -> None:
        """After an eviction committed: remove the bytes and meter it."""
        if not evicted:
            return
        now = self.clock()
        scopes = self._scopes_of({e.namespace_id for e in evicted})
        for item in evicted:
            self.delete_extent_file(item.extent_id)
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
        try:
            return self.store_backend.delete(extent_id)
        except StorageError as err:
            logger.warning(
                "could not delete extent %s (left for the orphan sweep): %s", extent_id, err
            )
            return False

    def drop_extent(self, extent_id: str) -> None:
        """Remove an extent from the index (first) and the block store (second)."""
        with self.db.write() as session:
            tenant_id = session.scalar(select(Extent.tenant_id).where(Extent.id == extent_id))
            if tenant_id is not None:
                lock_tenants(session, [tenant_id])
            session.execute(delete(Block).where(Block.extent_id == extent_id))
            session.execute(delete(Extent).where(Extent.id == extent_id))
        self.delete_extent_file(extent_id)

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
    root: str | os.PathLike[str],
    *,
    database_url: str | None = None,
    master_key: MasterKeyProvider | KeyWrapper | None = None,
    block_store: BlockStore | None = None,
    suite: CipherSuite | str | int = DEFAULT_SUITE,
    durable: bool = True,
    strict: bool = False,
    workers: int | None = None,
    load_threads: int | None = None,
    staging_bytes: int = DEFAULT_RING_BYTES,
    staging_slot_bytes: int = DEFAULT_SLOT_BYTES,
    capacity_bytes: int | None = None,
    allow_overcommit: bool | None = None,
    default_quota_bytes: int = DEFAULT_QUOTA_BYTES,
    hit_cost: float = DEFAULT_HIT_COST,
    gc_interval: float | None = None,
    clock: Callable[[], float] = time.time,
) -> TenantKV:
    """Open (creating if needed) a cache rooted at ``root``.

    Defaults are the embedded setup: SQLite index ``<root>/index.db`` (WAL), extents under
    ``<root>/blocks``, master key from ``TENANTKV_MASTER_KEY`` or the key file
    ``<root>/master.key`` (created 0600 on first use). ``strict=True`` raises
    CacheUnavailableError where the serving path would otherwise degrade to a miss.

    ``workers`` threads (default one per core) seal stores; ``load_threads`` threads (default
    ``max(2, workers)``) read and open the chunks of every load; ``staging_bytes`` (default
    64 MiB) bounds the host memory all loads use for ciphertext in flight, in slots of
    ``staging_slot_bytes`` (default 8 MiB).

    Quotas reserve capacity: ``capacity_bytes`` (persisted; default the size of the file system
    holding the root) bounds the sum of tenant quotas unless ``allow_overcommit=True``
    (persisted and recorded: it lets one tenant's growth crowd out another's reserved space).
    ``default_quota_bytes`` (1 GiB) applies to tenants created without a quota; ``hit_cost``
    (1/50) prices a token served from cache relative to a missed one; ``gc_interval`` starts a
    background GC. ``clock`` is injectable for tests.
    """
    for name, value in (
        ("staging_bytes", staging_bytes),
        ("staging_slot_bytes", staging_slot_bytes),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidRequestError(f"{name} must be a positive number of bytes")
    if staging_bytes < staging_slot_bytes:
        raise InvalidRequestError("staging_bytes must hold at least one staging slot")
    try:
        parsed_suite = CipherSuite.parse(suite)
    except ValueError as err:
        raise InvalidRequestError(str(err)) from None
    root_path = Path(root)
    root_path.mkdir(parents=True, exist_ok=True)
    url = database_url or config.default_database_url(root_path)
    wrapper: KeyWrapper
    if master_key is None:
        wrapper = KeyEncryptionKey(default_master_key_provider(root_path / "master.key").load())
    elif isinstance(master_key, KeyWrapper):
        wrapper = master_key
    else:
        wrapper = KeyEncryptionKey(master_key.load())
    store = block_store or LocalBlockStore(root_path / "blocks", durable=durable)
    return TenantKV(
        root=root_path,
        database=Database(url),
        block_store=store,
        key_wrapper=wrapper,
        suite=parsed_suite,
        strict=strict,
        workers=workers,
        load_threads=load_threads,
        staging_bytes=staging_bytes,
        staging_slot_bytes=staging_slot_bytes,
        capacity_bytes=capacity_bytes,
        allow_overcommit=allow_overcommit,
        default_quota_bytes=default_quota_bytes,
        hit_cost=hit_cost,
        gc_interval=gc_interval,
        clock=clock,
    )
