"""What the scheduler-side connector tells the worker-side one each step.

The worker trusts it: both run inside the same engine, and the scheduler has already verified
the request's assertion. Only the verified owner travels, never the assertion or a salt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ..engine_identity import RequestTenant


@dataclass(frozen=True)
class LoadSpec:
    """Load the cached prefix ``token_ids`` and write blocks ``first_block..`` of it into the
    pages ``block_ids[first_block:]`` (the engine computed or shares the blocks before)."""

    request_id: str
    owner: RequestTenant
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    first_block: int
    asynchronous: bool


@dataclass(frozen=True)
class SaveSpec:
    """Store the prompt's full blocks ``token_ids`` from the pages ``block_ids``; blocks before
    ``start_block`` were cached when the request was looked up and are not copied again."""

    request_id: str
    owner: RequestTenant
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start_block: int


@dataclass
class TenantKVConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """``preempted``: requests vLLM preempted this step; their pages may be overwritten by the
    coming forward step, so the worker finishes their saves first (``handle_preemptions``)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: frozenset[str] = frozenset()


@dataclass
class TenantKVWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What the worker tells the scheduler side each step: the requests whose background saves
    finished (stored or failed), so that lookups waiting for them go on."""

    saved: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """One worker per engine (the connector stores whole layers): the union."""
        assert isinstance(other, TenantKVWorkerMetadata), f"foreign worker metadata {type(other)}"
        return TenantKVWorkerMetadata(self.saved | other.saved)
