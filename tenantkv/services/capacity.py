"""The store's capacity and overcommit policy: index state, changed by an audited call."""

from __future__ import annotations

import shutil
from typing import Any

from ..audit import Attribution
from ..components.context import CacheContext
from ..errors import InvalidRequestError, QuotaExceededError
from ..index import capacity
from ..index.quota import total_quota
from .tenants import check_quota

CAPACITY_UPDATE = "capacity.update"


def init_capacity(ctx: CacheContext) -> None:
    """On the index's first open: the capacity is the size of the file system holding the
    root, without overcommit (recorded like any change of it)."""
    with ctx.index.write() as session:
        if capacity.read(session, lock=True) is not None:
            return
        initial = capacity.Capacity(shutil.disk_usage(ctx.config.root).total, False)
        capacity.write(session, initial)
        ctx.audit.append(session, _event(ctx.attribution, initial))


def read_capacity(ctx: CacheContext) -> capacity.Capacity:
    with ctx.index.read() as session:
        value = capacity.read(session)
    assert value is not None, "the capacity is set when the index is first opened"
    return value


def set_capacity(
    ctx: CacheContext,
    capacity_bytes: int | None,
    allow_overcommit: bool | None,
    by: Attribution,
) -> dict[str, Any]:
    """See ``TenantKV.set_capacity``."""
    if capacity_bytes is not None:
        check_quota(capacity_bytes)
    if allow_overcommit is not None and not isinstance(allow_overcommit, bool):
        raise InvalidRequestError("allow_overcommit must be a boolean")
    with ctx.index.write() as session:
        stored = capacity.read(session, lock=True)
        assert stored is not None, "the capacity is set when the index is first opened"
        new = capacity.Capacity(
            stored.capacity_bytes if capacity_bytes is None else capacity_bytes,
            stored.allow_overcommit if allow_overcommit is None else allow_overcommit,
        )
        if not new.allow_overcommit:
            reserved = total_quota(session)
            if reserved > new.capacity_bytes:
                raise QuotaExceededError(
                    f"tenants reserve {reserved} bytes, more than a capacity of "
                    f"{new.capacity_bytes}; raise the capacity, lower quotas, or allow "
                    "overcommit"
                )
        if new != stored:
            capacity.write(session, new)
            ctx.audit.append(session, _event(by, new))
    if new.allow_overcommit != stored.allow_overcommit:
        ctx.incidents.log.record(
            "overcommit_changed",
            "",
            f"quota overcommit {'allowed' if new.allow_overcommit else 'disallowed'} "
            "by the operator",
        )
    return {"capacity_bytes": new.capacity_bytes, "allow_overcommit": new.allow_overcommit}


def _event(by: Attribution, value: capacity.Capacity) -> Any:
    details = {"capacity_bytes": value.capacity_bytes, "allow_overcommit": value.allow_overcommit}
    return by.event(None, CAPACITY_UPDATE, "store", details=details)
