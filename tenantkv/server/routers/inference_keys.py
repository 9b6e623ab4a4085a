"""Inference keys of a tenant (``/v1/tenants/{name}/inference-keys``): operators, and the
tenant's own tenant-admins (another tenant's: 404, as if it did not exist). A key is returned
once, at creation; listings show ids, metadata and use counts only."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response
from pydantic import BaseModel, ConfigDict, Field

from ...services.inference_keys import MAX_EXPIRES_IN, MAX_SCOPE, InferenceKeyInfo
from ..dependencies import KV, TenantCaller
from ..errors import ApiError

router = APIRouter(tags=["inference-keys"])

KeyId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")]
_NO_KEY = {"error": "not_found", "detail": "no such inference key"}


class InferenceKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    scope: str | None = Field(default=None, min_length=1, max_length=MAX_SCOPE)
    expires_in: float | None = Field(
        default=None, gt=0, le=MAX_EXPIRES_IN, allow_inf_nan=False, description="seconds"
    )


class InferenceKeyOut(BaseModel):
    id: str
    name: str
    tenant: str
    scope: str | None
    created_at: float
    created_by: str
    expires_at: float | None
    revoked_at: float | None
    uses: int
    last_used_at: float | None

    @classmethod
    def of(cls, info: InferenceKeyInfo) -> InferenceKeyOut:
        return cls(**info.__dict__)


class InferenceKeyCreated(InferenceKeyOut):
    key: str = Field(description="shown once; only its hash is kept")


@router.post(
    "/v1/tenants/{name}/inference-keys", status_code=201, response_model=InferenceKeyCreated
)
def create_inference_key(
    name: str, body: InferenceKeyCreate, kv: KV, caller: TenantCaller
) -> InferenceKeyCreated:
    """A new inference key for this tenant and a scope (operators, or this tenant's admins)."""
    info, secret = kv.inference_keys.create(
        name, body.name, scope=body.scope, expires_in=body.expires_in, actor=caller.attribution
    )
    return InferenceKeyCreated(key=secret, **info.__dict__)


@router.get("/v1/tenants/{name}/inference-keys", response_model=list[InferenceKeyOut])
def list_inference_keys(name: str, kv: KV, caller: TenantCaller) -> list[InferenceKeyOut]:
    return [InferenceKeyOut.of(info) for info in kv.inference_keys.list(name)]


@router.delete("/v1/tenants/{name}/inference-keys/{key_id}", status_code=204)
def revoke_inference_key(name: str, key_id: KeyId, kv: KV, caller: TenantCaller) -> Response:
    if not kv.inference_keys.revoke(name, key_id, actor=caller.attribution):
        raise ApiError(404, dict(_NO_KEY))
    return Response(status_code=204)
