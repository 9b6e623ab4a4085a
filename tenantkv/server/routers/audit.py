"""``/v1/audit``: streamed exports, signed checkpoints, the verification key.

Who exports what: operators and auditors any chain (``tenant=`` the chain of the tenant of that
name as it exists now, ``chain=`` any one chain by id, e.g. a deleted tenant's or an earlier
incarnation's; none: every chain, the system chain included); a tenant-admin only its own
tenant's current chain (another name is the no-oracle 404). A tenant that does not exist is that
same 404 for every role, for exports, checkpoint listings and new checkpoints alike. Each export
is audited, before it streams, on the chain it exports (the system chain for an all-chains or
``chain=`` export).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Final

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ...audit import (
    AUDIT_EXPORT,
    ROLE_TENANT_ADMIN,
    SYSTEM_CHAIN,
    TENANT_CHAIN_PREFIX,
    Checkpoint,
    ExportFormat,
    is_chain_of,
)
from ...services.audit import MAX_CHECKPOINTS
from ..caller import Caller
from ..dependencies import KV, AnyRole, AuditReader, Operator, refuse
from ..errors import not_found

router = APIRouter(prefix="/v1/audit", tags=["audit"])

MAX_TIME: Final = 1e11
_MEDIA: Final[dict[str, str]] = {
    "jsonl": "application/x-ndjson",
    "cef": "text/plain; charset=utf-8",
    "ocsf": "application/x-ndjson",
}
TenantParam = Annotated[str | None, Query(min_length=1, max_length=128)]
TimeParam = Annotated[float | None, Query(ge=0, le=MAX_TIME, allow_inf_nan=False)]
ChainParam = Annotated[
    str | None,
    Query(min_length=1, max_length=160, description="one chain by id (operators and auditors)"),
]


class CheckpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str | None = Field(default=None, min_length=1, max_length=128)


class CheckpointOut(BaseModel):
    chain: str
    seq: int
    head_hash: str
    count: int
    time_us: int
    key_id: str
    signature: str

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> CheckpointOut:
        return cls(
            chain=checkpoint.chain,
            seq=checkpoint.seq,
            head_hash=checkpoint.head_hash,
            count=checkpoint.count,
            time_us=checkpoint.time_us,
            key_id=checkpoint.key_id,
            signature=_text(checkpoint.signature),
        )


def _chain_tenant(request: Request, kv: KV, caller: Caller, tenant: str | None) -> str | None:
    """The tenant whose chain ``caller`` reads (None: every chain, or the system chain)."""
    if caller.role != ROLE_TENANT_ADMIN:
        return tenant
    own = caller.principal.tenant
    if tenant is not None and tenant != own:
        refuse(request, kv, caller, "other-tenant")
        raise not_found()
    return own


def _chain(
    request: Request, kv: KV, caller: Caller, tenant: str | None, chain: str | None
) -> str | None:
    """The one chain ``caller`` reads (None: every chain). ``tenant``: that tenant's current
    incarnation's chain, or the guards' 404 if there is no such tenant; ``chain``: that chain,
    for operators and auditors (a tenant-admin gets the 404 for any chain but its own)."""
    chain_tenant = _chain_tenant(request, kv, caller, tenant)
    current: str | None = None
    if chain_tenant is not None:
        current = kv.audit.current_chain(chain_tenant)
        if current is None:
            raise not_found()
    if chain is None:
        return current
    if caller.role == ROLE_TENANT_ADMIN and chain != current:
        refuse(request, kv, caller, "other-tenant")
        raise not_found()
    if chain_tenant is not None and not is_chain_of(chain, chain_tenant):
        raise not_found()
    if chain != SYSTEM_CHAIN and not chain.startswith(TENANT_CHAIN_PREFIX):
        raise not_found()
    return chain


@router.get("/export", response_class=StreamingResponse)
def export(
    request: Request,
    kv: KV,
    caller: AuditReader,
    tenant: TenantParam = None,
    since: TimeParam = None,
    until: TimeParam = None,
    fmt: ExportFormat = "jsonl",
    chain: ChainParam = None,
) -> StreamingResponse:
    """Stream the log as JSON Lines (verifiable offline with ``tenantkv audit verify``), CEF
    or OCSF. The set of records is fixed when the export starts."""
    chain_tenant = _chain_tenant(request, kv, caller, tenant)
    only = _chain(request, kv, caller, tenant, chain)
    lines = iter(
        kv.audit.export(tenant=chain_tenant, since=since, until=until, fmt=fmt, chain=only)
    )
    kv.audit.record(
        caller.event(
            chain_tenant,
            AUDIT_EXPORT,
            only or "all",
            details={"format": fmt, "since": since, "until": until},
        )
    )

    # The export checks the chains it covers (MACs of their heads, the anchor file, purge
    # statements) before its first line: take that line now, so a log found tampered with is
    # a 409 here rather than a 200 whose body stops short.
    first = next(lines, None)

    def body() -> Iterator[bytes]:
        if first is None:
            return
        yield (first + "\n").encode("utf-8")
        for line in lines:
            yield (line + "\n").encode("utf-8")

    return StreamingResponse(body(), media_type=_MEDIA[fmt])


@router.get("/checkpoints", response_model=list[CheckpointOut])
def list_checkpoints(
    request: Request,
    kv: KV,
    caller: AuditReader,
    tenant: TenantParam = None,
    chain: ChainParam = None,
) -> list[CheckpointOut]:
    """Stored signed checkpoints of one chain (``tenant``'s current one, or ``chain``; none:
    the system chain)."""
    chain = _chain(request, kv, caller, tenant, chain) or SYSTEM_CHAIN
    return [CheckpointOut.of(c) for c in kv.audit.checkpoints(chain, limit=MAX_CHECKPOINTS)]


@router.post("/checkpoints", status_code=201, response_model=CheckpointOut)
def create_checkpoint(
    kv: KV, caller: Operator, body: CheckpointRequest | None = None
) -> CheckpointOut:
    """Sign the current head of a chain now (``tenant``'s current one; none: the system
    chain). The request is recorded on that chain first, so the checkpoint covers its own audit
    record. A tenant that does not exist is the guards' 404: no chain is started for it."""
    checkpoint = kv.audit.checkpoint(body.tenant if body else None, caller.attribution)
    if checkpoint is None:
        raise not_found()
    return CheckpointOut.of(checkpoint)


@router.get("/public-key", response_class=Response)
def public_key(kv: KV, caller: AnyRole) -> Response:
    """The Ed25519 checkpoint verification key (PEM), for ``tenantkv audit verify``."""
    return Response(kv.audit.public_key_pem(), media_type="application/x-pem-file")


def _text(value: object) -> str:
    return value.hex() if isinstance(value, bytes) else str(value)
