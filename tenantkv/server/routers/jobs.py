"""``/v1/jobs``: long operations (key retirement, purge, tenant deletion, GC) started by the
admin API run as jobs: the starting route answers 202 with the job (and its ``Location``), the
job runs in a thread of the server whatever becomes of the client, and ``GET /v1/jobs/{id}``
reports its state and progress. An interrupted or failed job resumes with
``POST /v1/jobs/{id}/resume`` (each operation is idempotent; ``tenantkv.services.jobs``).

Who sees a job: operators every one; a tenant-admin the jobs of its own tenant (another's, or
GC's, answer the same 404 as a job that does not exist: no oracle for other tenants' jobs).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ...audit import ROLE_OPERATOR
from ...errors import JobNotFoundError
from ...services.jobs import JobInfo
from ..caller import Caller
from ..dependencies import KV, Lister, Operator, refuse
from ..errors import ApiError

router = APIRouter(tags=["jobs"])

JobId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")]
_STATES = "^(queued|running|succeeded|failed|interrupted)$"
NO_JOB = {"error": "not_found", "detail": "no such job"}


class JobOut(BaseModel):
    id: str
    kind: str = Field(description="keys.retire, purge, tenant.delete or gc")
    tenant: str | None
    state: str = Field(description="queued, running, succeeded, failed or interrupted")
    created_at: float
    created_by: str
    started_at: float | None
    finished_at: float | None
    done: int = Field(description="steps done (extents or files)")
    total: int | None = Field(description="steps in all, once the job knows")
    attempts: int
    result: dict[str, Any] | None = Field(description="what the operation returned")
    error: str | None = Field(description="why it failed or was interrupted")

    @classmethod
    def of(cls, info: JobInfo) -> JobOut:
        return cls(**info.__dict__)


class GcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    orphan_grace: float | None = Field(
        default=None, ge=0, le=30 * 86400, allow_inf_nan=False, description="seconds"
    )


def accepted(info: JobInfo) -> JSONResponse:
    """The 202 a starting route answers: the job, and where to poll it."""
    return JSONResponse(
        JobOut.of(info).model_dump(),
        status_code=202,
        headers={"Location": f"/v1/jobs/{info.id}"},
    )


def _visible(request: Request, kv: KV, caller: Caller, job_id: str) -> JobInfo:
    try:
        info = kv.jobs.get(job_id)
    except JobNotFoundError:
        raise ApiError(404, dict(NO_JOB)) from None
    if caller.role != ROLE_OPERATOR and (
        info.tenant is None or info.tenant != caller.principal.tenant
    ):
        refuse(request, kv, caller, "other-tenant")
        raise ApiError(404, dict(NO_JOB))
    return info


@router.get("/v1/jobs/{job_id}", response_model=JobOut)
def get_job(job_id: JobId, request: Request, kv: KV, caller: Lister) -> JobOut:
    return JobOut.of(_visible(request, kv, caller, job_id))


@router.get("/v1/jobs", response_model=list[JobOut])
def list_jobs(
    kv: KV,
    caller: Lister,
    state: Annotated[
        str | None, Query(pattern="^(queued|running|succeeded|failed|interrupted)$")
    ] = None,
    limit: Annotated[int, Query(gt=0, le=1000)] = 50,
) -> list[JobOut]:
    """The newest jobs (a tenant-admin: its own tenant's only)."""
    jobs = kv.jobs.listing(state, limit)
    if caller.role != ROLE_OPERATOR:
        jobs = [
            job for job in jobs if job.tenant is not None and job.tenant == caller.principal.tenant
        ]
    return [JobOut.of(job) for job in jobs]


@router.post("/v1/jobs/{job_id}/resume", status_code=202, response_model=JobOut)
def resume_job(job_id: JobId, request: Request, kv: KV, caller: Lister) -> Response:
    """Run an interrupted or failed job again (409 for any other state)."""
    _visible(request, kv, caller, job_id)
    info = kv.jobs.resume(job_id)
    kv.jobs.run_in_background(job_id)
    return accepted(info)


@router.post("/v1/gc", status_code=202, response_model=JobOut)
def start_gc(kv: KV, caller: Operator, body: GcRequest | None = None) -> Response:
    """Collect expired extents and orphaned files, as a job (operators only)."""
    params = (
        {} if body is None or body.orphan_grace is None else {"orphan_grace": body.orphan_grace}
    )
    info = kv.jobs.start("gc", None, params, by=caller.attribution)
    kv.jobs.run_in_background(info.id)
    return accepted(info)
