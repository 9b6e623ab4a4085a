"""Tenant lifecycle: create, update, list, delete (crypto-shred), key rotation and retirement.

Every change to a tenant is one index transaction. Deletion destroys the tenant's keys in the
same transaction that removes it, before any byte is touched, so its extents are unreadable the
moment the deletion commits; their files are removed afterwards (and by GC's orphan sweep if a
crash intervenes).
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..audit import KEYS_ROTATE, TENANT_CREATE, TENANT_DELETE, TENANT_UPDATE, Attribution
from ..components.context import CacheContext
from ..components.metering import (
    BUCKET_SECONDS,
    USAGE_FIELDS,
    UsageReport,
    read_usage,
    read_usage_all,
)
from ..errors import InvalidRequestError, QuotaExceededError, TenantExistsError, TenantNotFoundError
from ..index import api_tokens, capacity, counters, inference_keys
from ..index import tenants as tenant_rows
from ..index.quota import Evicted, make_room, tenant_bytes, total_quota
from ..index.schema import Tenant
from ..retention import dumps as dumps_retention
from ..retention import loads as loads_retention
from ..retention import parse_retention
from ..storage import StorageError
from .evictions import discard_evicted
from .purge import Progress, remove_in_batches
from .shredding import scrub_after_shredding

logger = logging.getLogger(__name__)

_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class TenantInfo:
    name: str
    created_at: float
    key_version: int
    quota_bytes: int = 0
    retention: Mapping[str, float] | None = None  # class -> seconds
    used_bytes: int = 0
    key_versions: tuple[int, ...] = ()
    #: Which tenant of this name this is: its random id in hex, new each time the name is
    #: created. A gateway puts it in its assertions (``AssertionSigner.sign(incarnation=)``)
    #: so that they are refused once this tenant is deleted, whoever takes the name next.
    incarnation: str = ""


@dataclass(frozen=True)
class TenantIncarnation:
    """What binds a tenant assertion to the tenant holding the name now (and nothing else of
    the tenant: engines look it up on their serving path)."""

    name: str
    incarnation: str
    created_at: float


def incarnation_hex(tenant_id: bytes) -> str:
    """The incarnation id of the tenant whose row id is ``tenant_id`` (the audit log's chains
    name an incarnation by its first 16 characters)."""
    return tenant_id.hex()


def check_tenant_name(name: Any) -> str:
    if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
        raise InvalidRequestError(
            f"tenant name {name!r} is invalid: 1-128 characters of letters, digits, '.', '_' "
            "or '-', starting with a letter or digit"
        )
    return name


def check_quota(quota_bytes: Any) -> int:
    if isinstance(quota_bytes, bool) or not isinstance(quota_bytes, int) or quota_bytes <= 0:
        raise InvalidRequestError(f"quota_bytes must be a positive integer, got {quota_bytes!r}")
    return quota_bytes


def _row(session: Session, name: str, *, lock: bool = False) -> Tenant:
    row = tenant_rows.find(session, name, lock=lock)
    if row is None:
        raise TenantNotFoundError(f"no tenant named {name!r}")
    return row


def _info(session: Session, row: Tenant) -> TenantInfo:
    versions = tenant_rows.key_versions(session, row.id)
    return TenantInfo(
        name=row.name,
        created_at=row.created_at,
        key_version=row.current_key_version,
        quota_bytes=row.quota_bytes,
        retention=loads_retention(row.retention),
        used_bytes=tenant_bytes(session, row.id),
        key_versions=versions,
        incarnation=incarnation_hex(row.id),
    )


def _check_capacity(
    ctx: CacheContext, session: Session, quota: int, tenant_id: bytes | None
) -> None:
    """Quotas reserve capacity: refuse a quota that would overcommit the store."""
    store = capacity.read(session, lock=True)  # quota changes take turns on the capacity
    assert store is not None, "the capacity is set when the index is first opened"
    if store.allow_overcommit:
        return
    reserved = total_quota(session, excluding=tenant_id)
    if reserved + quota > store.capacity_bytes:
        raise QuotaExceededError(
            f"a quota of {quota} bytes does not fit: {reserved} of the store's "
            f"{store.capacity_bytes} bytes are reserved by other tenants (quotas reserve "
            "capacity; an operator may allow overcommit, which weakens isolation)"
        )


def create_tenant(
    ctx: CacheContext,
    name: str,
    quota_bytes: int | None,
    retention: Mapping[str, Any] | None,
    by: Attribution,
) -> TenantInfo:
    check_tenant_name(name)
    quota = check_quota(ctx.config.default_quota_bytes if quota_bytes is None else quota_bytes)
    classes = parse_retention(retention)
    tenant_id = secrets.token_bytes(16)
    now = ctx.clock()
    wrapped = ctx.keys.new_data_key(tenant_id, 1)
    try:
        with ctx.index.write() as session:
            if tenant_rows.id_of(session, name) is not None:
                raise TenantExistsError(f"tenant {name!r} already exists")
            _check_capacity(ctx, session, quota, None)
            row = Tenant(
                id=tenant_id,
                name=name,
                created_at=now,
                updated_at=now,
                current_key_version=1,
                quota_bytes=quota,
                retention=dumps_retention(classes),
            )
            tenant_rows.add(session, row, wrapped)
            info = _info(session, row)
            ctx.audit.append(
                session,
                by.event(
                    name,
                    TENANT_CREATE,
                    name,
                    details={"quota_bytes": quota, "retention": classes},
                ),
            )
    except IntegrityError as err:  # a concurrent create won the race
        raise TenantExistsError(f"tenant {name!r} already exists") from err
    return info


def update_tenant(
    ctx: CacheContext,
    name: str,
    quota_bytes: int | None,
    retention: Mapping[str, Any] | None,
    by: Attribution,
) -> TenantInfo:
    """Change a tenant's quota and/or retention. A smaller quota evicts down to it at once; a
    new retention applies to existing extents from their last use (in a block store that
    expires extents by itself too, see :func:`_extend_store_ttls`)."""
    if quota_bytes is not None:
        check_quota(quota_bytes)
    now = ctx.clock()
    given: dict[str, float] = {}
    retimed: list[str] = []
    with ctx.index.write() as session:
        row = _row(session, name, lock=True)
        evicted: list[Evicted] = []
        if retention is not None:
            given = _given(retention)
            row.retention = dumps_retention({**loads_retention(row.retention), **given})
            # Only the classes given change; one statement restarts them all.
            tenant_rows.restart_retention(session, row.id, given)
            if given and ctx.blocks.capabilities.expires:
                retimed = tenant_rows.extent_ids(session, row.id, kinds=given)
        if quota_bytes is not None:
            _check_capacity(ctx, session, quota_bytes, row.id)
            row.quota_bytes = quota_bytes
            # The operator's quota takes effect now: a running load's extent leaves the
            # index if it must, and its bytes stay until the load's lease ends.
            evicted = make_room(
                session,
                row.id,
                quota_bytes,
                now,
                held=lambda ids: ctx.leases.held(session, ids),
                evict_leased=True,
            )
        row.updated_at = now
        session.flush()
        info = _info(session, row)
        changes: dict[str, Any] = {"evicted_extents": len(evicted)}
        if quota_bytes is not None:
            changes["quota_bytes"] = quota_bytes
        if retention is not None:
            changes["retention"] = dict(info.retention or {})
        ctx.audit.append(session, by.event(name, TENANT_UPDATE, name, details=changes))
    discard_evicted(ctx, row.id, evicted, name)
    _extend_store_ttls(ctx, retimed, given, evicted)
    return info


def _extend_store_ttls(
    ctx: CacheContext, extent_ids: list[str], given: Mapping[str, float], evicted: list[Evicted]
) -> None:
    """A block store that expires extents by itself got each one's TTL at its last store or
    load; a changed retention restarts those TTLs now, passing the longest given class as the
    hint :meth:`~storage.base.BlockStore.retain` takes. The store applies its own rule: Redis
    gives every extent one fixed TTL at least the longest retention a tenant may have, so the
    TTLs reveal no class, and the index stays what decides expiry (GC removes the bytes). A
    store whose rule followed the hint would otherwise drop extents the index still serves.
    Best effort, like every TTL."""
    gone = {e.extent_id for e in evicted}
    ids = [i for i in extent_ids if i not in gone]
    if not ids:
        return
    try:
        ctx.blocks.retain(ids, max(given.values()))
    except StorageError as err:
        logger.warning("could not extend extent TTLs in the block store: %s", err)


def _given(retention: Mapping[str, Any]) -> dict[str, float]:
    """Only the classes named in ``retention``, parsed."""
    parsed = parse_retention(retention)
    return {kind: parsed[kind] for kind in retention}


def get_tenant(ctx: CacheContext, name: str) -> TenantInfo:
    with ctx.index.read() as session:
        return _info(session, _row(session, name))


def current_incarnation(ctx: CacheContext, name: str) -> TenantIncarnation | None:
    """The incarnation of the tenant named ``name`` now, or None when there is none (one row
    read, no sums: engines ask it for the tenants of the requests they serve)."""
    with ctx.index.read() as session:
        row = tenant_rows.find(session, name)
        if row is None:
            return None
        return TenantIncarnation(row.name, incarnation_hex(row.id), row.created_at)


def list_tenants(ctx: CacheContext) -> list[TenantInfo]:
    with ctx.index.read() as session:
        return [_info(session, row) for row in tenant_rows.all_by_name(session)]


def delete_tenant(
    ctx: CacheContext, name: str, by: Attribution, progress: Progress | None = None
) -> int:
    """Crypto-shred a tenant: keys, index rows, its admin API tokens and its inference keys go
    in one transaction, then the bytes.

    The tokens are revoked here, whoever deletes (Python, CLI or HTTP), and in the deletion's
    own transaction: a token minted by a request racing the deletion either committed first
    (and is revoked here) or finds the tenant gone. Returns the number of extents whose files
    were removed; ``progress`` follows that removal.
    """
    with ctx.index.write() as session:
        row = _row(session, name, lock=True)
        tenant_id = row.id
        extent_ids = tenant_rows.extent_ids(session, tenant_id)
        namespace_ids = tenant_rows.namespace_ids(session, tenant_id)
        revoked = api_tokens.revoke_all_of(session, tenant_id, ctx.clock())
        keys_revoked = inference_keys.revoke_all_of(session, tenant_id, ctx.clock())
        tenant_rows.shred(session, row)  # keys first, in the same transaction
        counters.bump(session, counters.KEY_EPOCH)  # other nodes drop its cached keys
        ctx.audit.append(
            session,
            by.event(
                name,
                TENANT_DELETE,
                name,
                details={
                    "extents": len(extent_ids),
                    "namespaces": len(namespace_ids),
                    "tokens_revoked": revoked,
                    "inference_keys_revoked": keys_revoked,
                },
                tenant_id=tenant_id,  # the row is gone by now: name the incarnation
            ),
        )
    ctx.keys.forget_tenant(tenant_id, namespace_ids)  # running loads of it stop here too
    scrub_after_shredding(ctx, f"deleting tenant {name!r}")
    ctx.meter.forget_tenant(tenant_id)
    return remove_in_batches(ctx, list(extent_ids), progress)


def rotate_keys(ctx: CacheContext, name: str, by: Attribution) -> int:
    """Start a new data-key version for new writes; return it. Old versions stay readable."""
    with ctx.index.write() as session:
        row = _row(session, name, lock=True)
        version = row.current_key_version + 1
        wrapped = ctx.keys.new_data_key(row.id, version)
        tenant_rows.add_data_key(session, row.id, version, wrapped, ctx.clock())
        row.current_key_version = version
        row.updated_at = ctx.clock()
        counters.bump(session, counters.KEY_EPOCH)
        ctx.audit.append(
            session, by.event(name, KEYS_ROTATE, name, details={"new_version": version})
        )
    return version


def check_window(since: float | None, until: float | None, now: float) -> None:
    """Refuse a window that is empty or shorter than the metering resolution: counters are kept
    per ``BUCKET_SECONDS`` bucket and counted by the bucket's start, so a shorter window would
    hold no bucket (or one that is mostly outside it) and read as zeros that mean nothing.
    A window without ``until`` runs to ``now`` (one starting later is simply empty so far)."""
    if since is None:
        return
    if until is not None and since >= until:
        raise InvalidRequestError("since must be before until")
    end = now if until is None else until
    if 0 < end - since < BUCKET_SECONDS:
        raise InvalidRequestError(
            f"the usage window spans {end - since:g} seconds, less than the metering "
            f"resolution of {BUCKET_SECONDS} seconds"
        )


def usage(
    ctx: CacheContext,
    name: str,
    scope: str | None,
    since: float | None,
    until: float | None,
) -> UsageReport:
    """Metering of ``name`` (one ``scope``, or all) for buckets starting in [since, until)."""
    check_window(since, until, ctx.clock())
    ctx.meter.flush(ctx.index)
    with ctx.index.read() as session:
        tenant_id = tenant_rows.id_of(session, name)
    if tenant_id is None:
        raise TenantNotFoundError(f"no tenant named {name!r}")
    counters = read_usage(ctx.index, tenant_id, scope, since, until)
    return UsageReport(name, scope, since, until, counters, ctx.config.hit_cost)


def usage_of_all(ctx: CacheContext, since: float | None, until: float | None) -> list[UsageReport]:
    """Every tenant's metering over one window, by tenant name (tenants with no use in it
    included, at zero): what an operator's usage table shows, read in one query."""
    check_window(since, until, ctx.clock())
    ctx.meter.flush(ctx.index)
    with ctx.index.read() as session:
        names = tenant_rows.names_and_ids(session)
    counters = read_usage_all(ctx.index, since, until)
    zero = dict.fromkeys(USAGE_FIELDS, 0)
    return [
        UsageReport(name, None, since, until, counters.get(tenant_id, zero), ctx.config.hit_cost)
        for tenant_id, name in sorted(names, key=lambda pair: pair[1])
    ]
