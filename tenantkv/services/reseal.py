"""Re-sealing: move extents sealed under old data-key versions to the current one.

Retiring a key version must not lose cached data still sealed with it, so each such extent is
read, every indexed segment opened under the old key and sealed under the current one into a new
extent (a fresh salt, so fresh nonces), and the index is switched over in one transaction; the
old file goes after the commit. Segments of slots no block references (a store that lost a race)
cannot be opened without their block key and are simply left behind, so the new extent holds the
referenced blocks only. An extent that fails to open is dropped and recorded as a security event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..audit import KEYS_RETIRE, SEGMENT_OPEN_FAILED, Attribution
from ..components.context import CacheContext
from ..crypto import CipherSuite, ExtentCipher, SealOpenError, SegmentContext, new_salt
from ..datapath.extent_format import HEADER_BYTES, ExtentGeometry, header_codec
from ..errors import TenantNotFoundError
from ..index import counters, extents
from ..index import tenants as tenant_rows
from ..index.quota import lock_tenants
from ..index.schema import Extent
from ..storage import StorageError
from .shredding import scrub_after_shredding


@dataclass(frozen=True)
class ResealOutcome:
    resealed: int
    dropped: int
    skipped_in_use: int


def _data_key(ctx: CacheContext, tenant_id: bytes, version: int) -> bytes:
    with ctx.index.read() as session:
        wrapped = tenant_rows.wrapped_data_key(session, tenant_id, version)
    if wrapped is None:
        raise SealOpenError(f"data key version {version} is gone")
    return ctx.keys.data_key(tenant_id, version, wrapped)


Progress = Callable[[int, int], None]  # (extents handled, extents on old keys)


def reseal_tenant(
    ctx: CacheContext,
    tenant: str,
    tenant_id: bytes,
    current: int,
    progress: Progress | None = None,
) -> ResealOutcome:
    with ctx.index.read() as session:
        old_extents = extents.sealed_before(session, tenant_id, current)
    new_key = _data_key(ctx, tenant_id, current)
    resealed = dropped = skipped = 0
    if progress is not None:
        progress(0, len(old_extents))
    for handled, extent in enumerate(old_extents, 1):
        if progress is not None and handled > 1:
            progress(handled - 1, len(old_extents))
        with ctx.index.read() as session:  # checked per extent: loads start and end meanwhile
            in_use = bool(ctx.leases.held(session, [extent.id]))
        if in_use:
            skipped += 1
            continue
        try:
            _reseal_one(ctx, extent, new_key, current)
            resealed += 1
        except (SealOpenError, StorageError) as err:
            ctx.incidents.record(
                "segment_open_failed", tenant, f"re-seal of {extent.id}: {err}", SEGMENT_OPEN_FAILED
            )
            ctx.remover.drop_now(extent.id)
            dropped += 1
    if progress is not None:
        progress(len(old_extents), len(old_extents))
    return ResealOutcome(resealed, dropped, skipped)


def _reseal_one(ctx: CacheContext, extent: Extent, new_key: bytes, version: int) -> None:
    with ctx.index.read() as session:
        blocks = extents.referenced_slots(session, extent.id)
    if not blocks:  # nothing references it: nothing to keep
        ctx.remover.drop_now(extent.id)
        return
    suite = CipherSuite(extent.suite)
    # The codec byte is read from the extent's own header; the old segments' associated data
    # binds it, so a forged byte fails to open below. The new extent keeps the codec.
    header = bytearray(HEADER_BYTES)
    with ctx.blocks.open(extent.id) as reader:
        reader.readinto(0, [header])
    codec = header_codec(bytes(header))
    old = ExtentGeometry(
        extent.num_blocks, extent.num_layers, extent.segment_bytes, suite, codec=codec
    )
    new = ExtentGeometry(
        len(blocks), extent.num_layers, extent.segment_bytes, ctx.config.suite, codec=codec
    )
    old_key = _data_key(ctx, extent.tenant_id, extent.key_version)
    old_cipher = ExtentCipher(
        old_key,
        extent.salt,
        SegmentContext(extent.tenant_id, extent.key_version, extent.namespace_id, codec),
        suite,
    )
    salt = new_salt()
    new_cipher = ExtentCipher(
        new_key,
        salt,
        SegmentContext(extent.tenant_id, version, extent.namespace_id, codec),
        ctx.config.suite,
    )
    sealed = bytearray(old.sealed_bytes)
    plain = bytearray(old.segment_bytes)
    out = bytearray(new.layer_stride)
    with ctx.blocks.open(extent.id) as reader, ctx.blocks.create() as writer:
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
        # As long as the extent it replaces has left (at least a minute, for the switch-over).
        new_id = writer.commit(retain_for=max(60.0, extent.expires_at - ctx.clock()))
    try:
        with ctx.index.write() as session:
            replacement = Extent(
                id=new_id,
                namespace_id=extent.namespace_id,
                tenant_id=extent.tenant_id,
                key_version=version,
                kind=extent.kind,
                suite=int(ctx.config.suite),
                salt=salt,
                num_blocks=new.num_blocks,
                num_layers=new.num_layers,
                segment_bytes=new.segment_bytes,
                size_bytes=new.total_bytes,
                created_at=extent.created_at,
                last_used_at=extent.last_used_at,
                expires_at=extent.expires_at,
            )
            lock_tenants(session, [extent.tenant_id])
            extents.switch_over(session, extent, replacement, [key for key, _ in blocks])
    except BaseException:
        ctx.blocks.delete(new_id)
        raise
    ctx.remover.remove_bytes([extent.id])


def retire_keys(
    ctx: CacheContext, name: str, by: Attribution, progress: Progress | None = None
) -> dict[str, Any]:
    """Re-seal every extent sealed with an old key version under the current one, then
    destroy the old versions that nothing uses any more (see ``TenantKV.retire_keys``);
    ``progress`` follows the extents re-sealed."""
    with ctx.index.read() as session:
        row = tenant_rows.find(session, name)
        if row is None:
            raise TenantNotFoundError(f"no tenant named {name!r}")
        tenant_id, current = row.id, row.current_key_version
    outcome = reseal_tenant(ctx, name, tenant_id, current, progress)
    with ctx.index.write() as session:
        row = tenant_rows.get(session, tenant_id)
        if row is None:
            raise TenantNotFoundError(f"no tenant named {name!r}")
        retired = tenant_rows.unused_old_versions(session, row)
        if retired:
            tenant_rows.delete_data_keys(session, tenant_id, retired)
            counters.bump(session, counters.KEY_EPOCH)  # other nodes drop the old keys
        remaining = tenant_rows.count_extents_with_old_keys(session, row)
        result: dict[str, Any] = {
            "resealed": outcome.resealed,
            "dropped": outcome.dropped,
            "skipped_in_use": outcome.skipped_in_use,
            "retired_versions": sorted(retired),
            "extents_on_old_keys": remaining,
        }
        ctx.audit.append(session, by.event(name, KEYS_RETIRE, name, details=result))
    ctx.keys.forget_versions(tenant_id, retired)
    scrubbed = not retired or scrub_after_shredding(ctx, f"retiring keys of {name!r}")
    return {**result, "scrub_complete": scrubbed}
