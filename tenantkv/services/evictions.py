"""After an eviction committed (rows gone): remove the bytes, meter it per scope and count it in
the metrics."""

from __future__ import annotations

from ..components.context import CacheContext
from ..index import namespaces
from ..index.quota import Evicted


def discard_evicted(
    ctx: CacheContext, tenant_id: bytes, evicted: list[Evicted], tenant: str
) -> None:
    """``tenant`` is the tenant's name (a metrics label when tenant labels are enabled)."""
    if not evicted:
        return
    now = ctx.clock()
    with ctx.index.read() as session:
        scopes = namespaces.scopes_of(session, {e.namespace_id for e in evicted})
    ctx.remover.remove_bytes([item.extent_id for item in evicted])
    for item in evicted:
        scope = scopes.get(item.namespace_id, "")
        if item.expired:
            ctx.meter.add(tenant_id, scope, now, expired_extents=1, expired_bytes=item.size_bytes)
        else:
            ctx.meter.add(tenant_id, scope, now, evicted_extents=1, evicted_bytes=item.size_bytes)
        ctx.metrics.removed(tenant, 1, item.size_bytes, expired=item.expired)
