"""The components of one open cache, built once by :func:`tenantkv.open`.

Services receive these parts (never the ``TenantKV`` facade), so dependencies point one way:
edges (server, CLI, integrations) -> facade -> services -> components (index, block store, keys,
runtime, leases) -> pure values. One place builds them, in order, and one place closes them.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..audit import ROLE_OPERATOR, Attribution, AuditLog
from ..config import CacheConfig
from ..crypto import KeyWrapper
from ..datapath.runtime import Runtime
from ..index.audit_chains import TenantAuditLog
from ..index.database import Database
from ..storage import BlockStore, LocalBlockStore, TieredBlockStore
from .coordination import KeyEpochWatcher, LeaseKeeper, new_node_id
from .extent_removal import ExtentRemover
from .health import HealthCounters
from .incidents import REFUSAL_AUDIT_FAILURES, SecurityIncidents
from .keyring import Keyring
from .lookup_cache import LookupCache
from .metering import Meter
from .metrics import DataPlaneMetrics, new_metrics
from .serving import ServingPolicy
from .use_records import UseRecords


@dataclass(frozen=True)
class CacheContext:
    config: CacheConfig
    index: Database
    blocks: BlockStore
    keys: Keyring
    runtime: Runtime
    meter: Meter
    incidents: SecurityIncidents
    health: HealthCounters
    #: Data-plane metrics in this cache's own registry (no-ops without prometheus_client).
    metrics: DataPlaneMetrics
    serving: ServingPolicy
    audit: AuditLog
    remover: ExtentRemover
    leases: LeaseKeeper
    #: Loads' records of use, written in batches after first layers (use_records.py).
    uses: UseRecords
    key_epoch: KeyEpochWatcher
    #: Block keys this node's lookups found present, per namespace (a cache of the index).
    lookups: LookupCache
    #: Whom this process's own actions are recorded as (the admin service passes its callers).
    attribution: Attribution
    #: Time of records, retention and metering (injectable for tests). Leases use the wall
    #: clock: every node must agree on them.
    clock: Callable[[], float]


def build_context(
    config: CacheConfig,
    *,
    index: Database,
    blocks: BlockStore,
    key_wrapper: KeyWrapper,
    clock: Callable[[], float] = time.time,
) -> CacheContext:
    """Wire the components together (nothing is read or written yet)."""
    keys = Keyring(key_wrapper)
    audit = TenantAuditLog(key_wrapper, clock=clock, anchor_path=config.anchor_file)
    attribution = Attribution(f"python-api@{socket.gethostname()}:{os.getpid()}", ROLE_OPERATOR)
    health = HealthCounters()
    remover = ExtentRemover(index, blocks)
    runtime = Runtime(config)
    try:
        return _wire(
            config, index, blocks, keys, audit, attribution, health, remover, runtime, clock
        )
    except BaseException:  # the runtime's threads and claimed CPUs go with the failed open
        runtime.shutdown(wait=False)
        raise


def _wire(
    config: CacheConfig,
    index: Database,
    blocks: BlockStore,
    keys: Keyring,
    audit: TenantAuditLog,
    attribution: Attribution,
    health: HealthCounters,
    remover: ExtentRemover,
    runtime: Runtime,
    clock: Callable[[], float],
) -> CacheContext:
    incidents = SecurityIncidents(
        index,
        audit,
        attribution,
        clock=clock,
        on_refusal_audit_failure=lambda: health.count(REFUSAL_AUDIT_FAILURES),
    )
    metrics = new_metrics(
        tenant_labels=config.metrics_tenant_labels,
        health=health.counts,
        security_events=incidents.log.counts,
    )
    if isinstance(blocks, TieredBlockStore):
        tiered = blocks
        metrics.watch_tiers(
            lambda: {tier: counts.get("hits", 0) for tier, counts in tiered.stats().items()}
        )
    # The rings of recent writes (storage/recent_writes.py) of a local store, or of a tiered
    # store's local tiers: opens they served, extents they kept and left out.
    tiers = blocks.tiers if isinstance(blocks, TieredBlockStore) else [blocks]
    rings = [t.recent for t in tiers if isinstance(t, LocalBlockStore) and t.recent is not None]
    if rings:
        metrics.watch_tiers(lambda: {"recent_writes": sum(ring.served for ring in rings)})
        metrics.watch_recent_writes(
            lambda: {
                "kept": sum(ring.kept for ring in rings),
                "left_out": sum(ring.left_out for ring in rings),
            }
        )
    return CacheContext(
        config=config,
        index=index,
        blocks=blocks,
        keys=keys,
        runtime=runtime,
        meter=Meter(),
        incidents=incidents,
        health=health,
        metrics=metrics,
        serving=ServingPolicy(config.strict, health),
        audit=audit,
        remover=remover,
        leases=LeaseKeeper(
            index, remover, node_id=new_node_id(), lease_seconds=config.lease_seconds
        ),
        # The runtime's submit_background is looked up at each batch, so that tests and
        # benchmarks can redirect the cache's bookkeeping.
        uses=UseRecords(index, blocks, remover, lambda task: runtime.submit_background(task)),
        key_epoch=KeyEpochWatcher(index, keys),
        lookups=LookupCache(config.lookup_cache_keys),
        attribution=attribution,
        clock=clock,
    )
