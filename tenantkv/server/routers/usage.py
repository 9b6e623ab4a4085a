"""``GET /v1/usage``: every tenant's metering over one window, for operators and auditors (a
bill run, a capacity review): one call and one index query instead of one per tenant."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from ...audit import ROLE_AUDITOR, ROLE_OPERATOR
from ..caller import Caller
from ..dependencies import KV, require_roles
from .tenants import TimeParam, UsageOut, usage_out, window

router = APIRouter(tags=["usage"])
UsageReader = Annotated[Caller, Depends(require_roles(ROLE_OPERATOR, ROLE_AUDITOR))]


@router.get("/v1/usage", response_model=list[UsageOut])
def usage_of_all(
    kv: KV, caller: UsageReader, since: TimeParam = None, until: TimeParam = None
) -> list[UsageOut]:
    """Each tenant's usage (by name; unused tenants at zero) for buckets starting in
    [since, until); the same window rules as a tenant's usage."""
    start, end = window(kv, since, until)
    return [usage_out(report) for report in kv.usage_of_all(since=start, until=end)]
