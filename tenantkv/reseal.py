"""Re-sealing: move extents sealed under old data-key versions to the current one.

Retiring a key version must not lose cached data still sealed with it, so each such extent is
read, every indexed segment opened under the old key and sealed under the current one into a new
extent (a fresh salt, so fresh nonces), and the index is switched over in one transaction; the
old file goes after the commit. Segments of slots no block references (a store that lost a race)
cannot be opened without their block key and are simply left behind, so the new extent holds the
referenced blocks only. An extent that fails to open is dropped and recorded as a security event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import delete, select, update

from .audit import SEGMENT_OPEN_FAILED
from .crypto import ExtentCipher, SealOpenError, SegmentContext, new_salt
from .extent_format import ExtentGeometry
from .models import Block, DataKey, Extent
from .quota import lock_tenants
from .storage import StorageError

if TYPE_CHECKING:
    from .cache import TenantKV


@dataclass(frozen=True)
class ResealOutcome:
    resealed: int
    dropped: int
    skipped_in_use: int


def _data_key(kv: TenantKV, tenant_id: bytes, version: int) -> bytes:
    with kv.db.read() as session:
        wrapped = session.scalar(
            select(DataKey.wrapped_key).where(
                DataKey.tenant_id == tenant_id, DataKey.version == version
            )
        )
    if wrapped is None:
        raise SealOpenError(f"data key version {version} is gone")
    return kv.keyring.data_key(tenant_id, version, wrapped)


def reseal_tenant(kv: TenantKV, tenant: str, tenant_id: bytes, current: int) -> ResealOutcome:
    with kv.db.read() as session:
        extents = session.scalars(
            select(Extent).where(Extent.tenant_id == tenant_id, Extent.key_version < current)
        ).all()
    new_key = _data_key(kv, tenant_id, current)
    resealed = dropped = skipped = 0
    for extent in extents:
        if extent.id in kv.pinned_extents():
            skipped += 1
            continue
        try:
            _reseal_one(kv, extent, new_key, current)
            resealed += 1
        except (SealOpenError, StorageError) as err:
            kv.record_security_event(
                "segment_open_failed", tenant, f"re-seal of {extent.id}: {err}", SEGMENT_OPEN_FAILED
            )
            kv.drop_extent(extent.id)
            dropped += 1
    return ResealOutcome(resealed, dropped, skipped)


def _reseal_one(kv: TenantKV, extent: Extent, new_key: bytes, version: int) -> None:
    with kv.db.read() as session:
        blocks = session.execute(
            select(Block.block_key, Block.slot)
            .where(Block.extent_id == extent.id)
            .order_by(Block.slot)
        ).all()
    if not blocks:  # nothing references it: nothing to keep
        kv.drop_extent(extent.id)
        return
    suite = kv.suite_of(extent.suite)
    old = ExtentGeometry(extent.num_blocks, extent.num_layers, extent.segment_bytes, suite)
    new = ExtentGeometry(len(blocks), extent.num_layers, extent.segment_bytes, kv.suite)
    old_key = _data_key(kv, extent.tenant_id, extent.key_version)
    old_cipher = ExtentCipher(
        old_key,
        extent.salt,
        SegmentContext(extent.tenant_id, extent.key_version, extent.namespace_id),
        suite,
    )
    salt = new_salt()
    new_cipher = ExtentCipher(
        new_key, salt, SegmentContext(extent.tenant_id, version, extent.namespace_id), kv.suite
    )
    sealed = bytearray(old.sealed_bytes)
    plain = bytearray(old.segment_bytes)
    out = bytearray(new.layer_stride)
    with kv.store_backend.open(extent.id) as reader, kv.store_backend.create() as writer:
        if reader.size != old.total_bytes:
            raise SealOpenError("extent size does not match the index")
        writer.write_at(0, new.header())
        view = memoryview(out)
        for layer in range(old.num_layers):
            for new_slot, (block_key, old_slot) in enumerate(blocks):
                reader.readinto(old.offset(layer, old_slot), [sealed])
                old_cipher.open_into(
                    old_slot, layer, block_key, memoryview(sealed), memoryview(plain)
                )
                stride = new.sealed_bytes
                new_cipher.seal_into(
                    new_slot,
                    layer,
                    block_key,
                    memoryview(plain),
                    view[new_slot * stride : (new_slot + 1) * stride],
                )
            writer.write_at(new.offset(layer, 0), out)
        new_id = writer.commit()
    try:
        with kv.db.write() as session:
            lock_tenants(session, [extent.tenant_id])
            session.add(
                Extent(
                    id=new_id,
                    namespace_id=extent.namespace_id,
                    tenant_id=extent.tenant_id,
                    key_version=version,
                    kind=extent.kind,
                    suite=int(kv.suite),
                    salt=salt,
                    num_blocks=new.num_blocks,
                    num_layers=new.num_layers,
                    segment_bytes=new.segment_bytes,
                    size_bytes=new.total_bytes,
                    created_at=extent.created_at,
                    last_used_at=extent.last_used_at,
                    expires_at=extent.expires_at,
                )
            )
            session.flush()
            for new_slot, (block_key, _old_slot) in enumerate(blocks):
                session.execute(
                    update(Block)
                    .where(Block.namespace_id == extent.namespace_id, Block.block_key == block_key)
                    .values(extent_id=new_id, slot=new_slot)
                )
            session.execute(delete(Extent).where(Extent.id == extent.id))
    except BaseException:
        kv.store_backend.delete(new_id)
        raise
    kv.delete_extent_file(extent.id)
