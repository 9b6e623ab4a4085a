"""The class vLLM builds, once as the scheduler's connector and once as each worker's.

It only routes: the scheduler role to :class:`SchedulerSide`, the worker role to
:class:`WorkerSide`, each over an :class:`EngineNamespaces` (the identity rule) on the cache
shared by the process.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

from ..engine_identity import EngineNamespaces
from .metadata import TenantKVConnectorMetadata, TenantKVWorkerMetadata
from .scheduler_side import SchedulerSide
from .settings import ConnectorSettings, layout_of, shared_cache
from .worker_side import WorkerSide


class TenantKVConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Per-tenant encrypted prefix caches for vLLM; tenant from a signed assertion only."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        model_config = vllm_config.model_config
        settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config or {}, str(model_config.model)
        )
        layout, layer_names, block_tokens = layout_of(kv_cache_config, model_config.hf_text_config)
        self.engine = EngineNamespaces(
            shared_cache(settings),
            settings.verifier(),
            model=settings.model,
            revision=settings.revision,
            layout=layout.with_codec(settings.codec),
            block_tokens=block_tokens,
        )
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(self.engine, block_tokens, settings.load_async)
        else:
            self.worker_side = WorkerSide(self.engine, layer_names, layer_wise=settings.layer_wise)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads and saves run between attention layers: graphs must let them."""
        return True

    # ---- scheduler side -----------------------------------------------------------------------

    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler-side call on a worker connector"
        return self.scheduler_side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> TenantKVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hold the pages of a request given a save until the worker reports it finished
        sending (its background save read them)."""
        return self._scheduler().request_finished(request), None

    # ---- worker side --------------------------------------------------------------------------

    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker-side call on the scheduler's connector"
        return self.worker_side

    def _meta(self) -> TenantKVConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TenantKVConnectorMetadata), f"foreign metadata {type(meta)}"
        return meta

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        layers = getattr(forward_context, "no_compile_layers", None) or {}
        caches = {
            name: layer.kv_cache
            for name, layer in layers.items()
            if getattr(layer, "kv_cache", None) is not None
        }
        self._worker().start_load_kv(self._meta(), caches)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._worker().save_kv_layer(self._meta(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        assert meta is None or isinstance(meta, TenantKVConnectorMetadata), type(meta)
        self._worker().wait_for_save(meta)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        assert isinstance(kv_connector_metadata, TenantKVConnectorMetadata)
        self._worker().handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished(finished_req_ids)

    def build_connector_worker_meta(self) -> TenantKVWorkerMetadata | None:
        return self._worker().worker_metadata()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
