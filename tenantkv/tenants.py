"""Tenant lifecycle: create, update, list, delete (crypto-shred), key rotation and retirement.

Every change to a tenant is one index transaction. Deletion destroys the tenant's keys in the
same transaction that removes it, before any byte is touched, so its extents are unreadable the
moment the deletion commits; their files are removed afterwards (and by GC's orphan sweep if a
crash intervenes).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from .audit import KEYS_ROTATE, TENANT_CREATE, TENANT_DELETE, TENANT_UPDATE, Attribution
from .errors import InvalidRequestError, QuotaExceededError, TenantExistsError, TenantNotFoundError
from .models import DataKey, Extent, Namespace, SchemaInfo, Tenant
from .quota import Evicted, make_room, tenant_bytes, total_quota
from .retention import dumps as dumps_retention
from .retention import loads as loads_retention
from .retention import parse_retention

if TYPE_CHECKING:
    from .cache import TenantKV

CAPACITY_ROW = "capacity_bytes"  # the tkv_schema row holding the store's capacity
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
    query = select(Tenant).where(Tenant.name == name)
    if lock:
        query = query.with_for_update()
    row = session.scalar(query)
    if row is None:
        raise TenantNotFoundError(f"no tenant named {name!r}")
    return row


def _info(session: Session, row: Tenant) -> TenantInfo:
    versions = tuple(
        session.scalars(
            select(DataKey.version).where(DataKey.tenant_id == row.id).order_by(DataKey.version)
        ).all()
    )
    return TenantInfo(
        name=row.name,
        created_at=row.created_at,
        key_version=row.current_key_version,
        quota_bytes=row.quota_bytes,
        retention=loads_retention(row.retention),
        used_bytes=tenant_bytes(session, row.id),
        key_versions=versions,
    )


def _check_capacity(kv: TenantKV, session: Session, quota: int, tenant_id: bytes | None) -> None:
    """Quotas reserve capacity: refuse a quota that would overcommit the store."""
    if kv.allow_overcommit:
        return
    # Quota changes of all tenants take turns on the capacity row: SQLite runs write
    # transactions one at a time anyway, but on PostgreSQL two of them could each see the
    # other's reservation missing and together overcommit the store.
    session.execute(
        select(SchemaInfo.name).where(SchemaInfo.name == CAPACITY_ROW).with_for_update()
    )
    reserved = total_quota(session, excluding=tenant_id)
    if reserved + quota > kv.capacity_bytes:
        raise QuotaExceededError(
            f"a quota of {quota} bytes does not fit: {reserved} of the store's "
            f"{kv.capacity_bytes} bytes are reserved by other tenants (quotas reserve capacity; "
            "an operator may allow overcommit, which weakens isolation)"
        )


def create_tenant(
    kv: TenantKV,
    name: str,
    quota_bytes: int | None,
    retention: Mapping[str, Any] | None,
    by: Attribution,
) -> TenantInfo:
    check_tenant_name(name)
    quota = check_quota(kv.default_quota_bytes if quota_bytes is None else quota_bytes)
    classes = parse_retention(retention)
    tenant_id = secrets.token_bytes(16)
    now = kv.clock()
    wrapped = kv.keyring.new_data_key(tenant_id, 1)
    try:
        with kv.db.write() as session:
            if session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
                raise TenantExistsError(f"tenant {name!r} already exists")
            _check_capacity(kv, session, quota, None)
            row = Tenant(
                id=tenant_id,
                name=name,
                created_at=now,
                updated_at=now,
                current_key_version=1,
                quota_bytes=quota,
                retention=dumps_retention(classes),
            )
            session.add(row)
            session.flush()
            session.add(
                DataKey(tenant_id=tenant_id, version=1, wrapped_key=wrapped, created_at=now)
            )
            session.flush()
            info = _info(session, row)
            kv.audit.append(
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
    kv: TenantKV,
    name: str,
    quota_bytes: int | None,
    retention: Mapping[str, Any] | None,
    by: Attribution,
) -> TenantInfo:
    """Change a tenant's quota and/or retention. A smaller quota evicts down to it at once; a
    new retention applies to existing extents from their last use."""
    if quota_bytes is not None:
        check_quota(quota_bytes)
    now = kv.clock()
    with kv.db.write() as session:
        row = _row(session, name, lock=True)
        evicted: list[Evicted] = []
        if retention is not None:
            classes = {**loads_retention(row.retention), **_given(retention)}
            row.retention = dumps_retention(classes)
            for kind, ttl in classes.items():
                session.execute(
                    update(Extent)
                    .where(Extent.tenant_id == row.id, Extent.kind == kind)
                    .values(expires_at=Extent.last_used_at + ttl)
                )
        if quota_bytes is not None:
            _check_capacity(kv, session, quota_bytes, row.id)
            row.quota_bytes = quota_bytes
            evicted = make_room(session, row.id, quota_bytes, now, kv.pinned_extents())
        row.updated_at = now
        session.flush()
        info = _info(session, row)
        changes: dict[str, Any] = {"evicted_extents": len(evicted)}
        if quota_bytes is not None:
            changes["quota_bytes"] = quota_bytes
        if retention is not None:
            changes["retention"] = dict(info.retention or {})
        kv.audit.append(session, by.event(name, TENANT_UPDATE, name, details=changes))
    kv.discard_evicted(row.id, evicted)
    return info


def _given(retention: Mapping[str, Any]) -> dict[str, float]:
    """Only the classes named in ``retention``, parsed."""
    parsed = parse_retention(retention)
    return {kind: parsed[kind] for kind in retention}


def get_tenant(kv: TenantKV, name: str) -> TenantInfo:
    with kv.db.read() as session:
        return _info(session, _row(session, name))


def list_tenants(kv: TenantKV) -> list[TenantInfo]:
    with kv.db.read() as session:
        rows = session.scalars(select(Tenant).order_by(Tenant.name)).all()
        return [_info(session, row) for row in rows]


def delete_tenant(kv: TenantKV, name: str, by: Attribution) -> int:
    """Crypto-shred a tenant: keys and index rows go in one transaction, then the bytes.

    Returns the number of extents whose files were removed.
    """
    with kv.db.write() as session:
        row = _row(session, name, lock=True)
        tenant_id = row.id
        extent_ids = list(session.scalars(select(Extent.id).where(Extent.tenant_id == tenant_id)))
        namespace_ids = list(
            session.scalars(select(Namespace.id).where(Namespace.tenant_id == tenant_id))
        )
        # Keys first: once this commits nothing left in the index opens the tenant's bytes.
        session.execute(delete(DataKey).where(DataKey.tenant_id == tenant_id))
        session.execute(delete(Namespace).where(Namespace.tenant_id == tenant_id))
        session.delete(row)  # cascades: extents, blocks, usage
        kv.audit.append(
            session,
            by.event(
                name,
                TENANT_DELETE,
                name,
                details={"extents": len(extent_ids), "namespaces": len(namespace_ids)},
            ),
        )
    kv.db.scrub_log()
    kv.keyring.forget_tenant(tenant_id, namespace_ids)
    kv.meter.forget_tenant(tenant_id)
    removed = 0
    for extent_id in extent_ids:
        removed += kv.delete_extent_file(extent_id)
    return removed


def rotate_keys(kv: TenantKV, name: str, by: Attribution) -> int:
    """Start a new data-key version for new writes; return it. Old versions stay readable."""
    with kv.db.write() as session:
        row = _row(session, name, lock=True)
        version = row.current_key_version + 1
        wrapped = kv.keyring.new_data_key(row.id, version)
        session.add(
            DataKey(tenant_id=row.id, version=version, wrapped_key=wrapped, created_at=kv.clock())
        )
        row.current_key_version = version
        row.updated_at = kv.clock()
        kv.audit.append(
            session, by.event(name, KEYS_ROTATE, name, details={"new_version": version})
        )
    return version


def unused_old_versions(session: Session, tenant: Tenant) -> list[int]:
    """Key versions older than the current one that no extent is sealed with."""
    in_use = set(
        session.scalars(
            select(Extent.key_version).where(Extent.tenant_id == tenant.id).distinct()
        ).all()
    )
    versions = session.scalars(
        select(DataKey.version).where(
            DataKey.tenant_id == tenant.id, DataKey.version < tenant.current_key_version
        )
    ).all()
    return [v for v in versions if v not in in_use]


def count_extents_with_old_keys(session: Session, tenant: Tenant) -> int:
    return int(
        session.scalar(
            select(func.count())
            .select_from(Extent)
            .where(Extent.tenant_id == tenant.id, Extent.key_version < tenant.current_key_version)
        )
        or 0
    )
