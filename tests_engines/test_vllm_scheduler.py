"""The connector against vLLM's real ``Scheduler`` and real paged KV tensors, without a model.

The scheduler-side connector answers the real scheduler (matched tokens, async loads,
preemption, load errors); the worker-side connector, built from the same config, loads into and
saves from page tensors shaped as vLLM's CPU backend allocates them ([B, H, N, K|V]).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from tenantkv.config import CacheConfig as TenantKVConfig
from tenantkv.errors import InvalidRequestError
from tenantkv.integrations import paged_kv
from tenantkv.integrations.engine_identity import ASSERTION_REFUSED, ENGINE_ERRORS, RequestTenant
from tenantkv.integrations.vllm import TenantKVConnector, scheduler_side, worker_side
from tenantkv.integrations.vllm.metadata import TenantKVConnectorMetadata
from tenantkv.integrations.vllm.settings import ENGINE_WINDOW, ConnectorSettings
from tenantkv.services.namespace import Namespace
from tenantkv.tenant_assertion import AssertionSigner
from tests.indexes import Index
from tests_engines.conftest import BLOCK

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, HEAD_DIM, NUM_BLOCKS = 2, 64, 64
LATENT = 512 + 64  # tiny_deepseek's kv_lora_rank + qk_rope_head_dim
PROMPT = list(range(10, 110))  # 100 tokens: 3 full blocks of 32 usable (the last token is not)
EOS = 2

pytestmark = pytest.mark.usefixtures("no_leftover_caches")


def kv_cache_config(*, mla: bool = False) -> KVCacheConfig:
    spec = (
        MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT, dtype=torch.float32)
        if mla
        else FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32
        )
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )


def vllm_config(model: Path, extra: dict[str, Any]) -> VllmConfig:
    model_config = ModelConfig(model=str(model), dtype="float32", seed=0, skip_tokenizer_init=True)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=512,
            max_model_len=512,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TenantKVConnector",
            kv_connector_module_path="tenantkv.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )


class Setup:
    """A cache with tenants acme and globex, a scheduler and a worker-side connector on it
    (``mla``: over a DeepSeek model's latent pages, ``[B, N, latent]`` as vLLM's CPU MLA
    layers hold them; ``layer_wise``: the connector's setting, its default unless told;
    ``strided_pages``: pages that are views of wider rows, which a load cannot decrypt into,
    so the connector copies each loaded layer in; ``mla_prefix_cache``: vLLM's own prefix
    cache on for an MLA model, as on a GPU host, where vLLM's CPU platform turns it off)."""

    def __init__(
        self,
        root: Path,
        index: Index,
        model: Path,
        pem: str,
        *,
        load_async: bool = False,
        codec: str | None = None,
        mla: bool = False,
        layer_wise: bool | str = True,
        strided_pages: bool = False,
        mla_prefix_cache: bool = False,
    ) -> None:
        self.root = root
        url = index.url(root)
        extra = {
            "root": str(root),
            "open_options": {"database_url": url, "durable": False},
            "gateway_public_keys": [pem],
            "model": "tiny-llama",
            "load_async": load_async,
            "layer_wise": layer_wise,
        }
        if codec is not None:
            extra["codec"] = codec
        self.config = vllm_config(model, extra)
        if mla_prefix_cache:  # vLLM's CPU platform turns it off for MLA; GPU hosts keep it
            self.config.cache_config.enable_prefix_caching = True
        self.config.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_cache_config(mla=mla),
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK,
        )
        self.connector = self.scheduler.connector
        assert isinstance(self.connector, TenantKVConnector)
        self.kv = self.connector.engine.kv
        for tenant in ("acme", "globex"):
            if tenant not in {t.name for t in self.kv.list_tenants()}:
                self.kv.create_tenant(tenant)
        self.worker = TenantKVConnector(
            self.config, KVConnectorRole.WORKER, kv_cache_config(mla=mla)
        )
        shape = (NUM_BLOCKS, BLOCK, LATENT) if mla else (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
        if strided_pages:  # views of wider rows: no token's row lies whole in the pages
            wider = (*shape[:-1], shape[-1] + 8)
            self.pages = {name: torch.zeros(wider)[..., : shape[-1]] for name in LAYERS}
        else:
            self.pages = {name: torch.zeros(shape) for name in LAYERS}
        self.worker.register_kv_caches(self.pages)

    def request(
        self,
        rid: str,
        params: dict[str, Any] | None,
        prompt: list[int] = PROMPT,
        *,
        salt: str | None = None,
    ) -> Request:
        """A request whose vLLM-side salt is its id unless ``salt`` is given: in a deployment
        the gateway sets ``cache_salt`` per tenant, or vLLM's own GPU prefix cache shares
        blocks across tenants (outside tenantkv; docs/engines.md)."""
        init_none_hash(sha256)
        sampling = SamplingParams(max_tokens=4)
        sampling.update_from_generation_config({}, EOS)
        request = Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=sampling,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
            cache_salt=salt or rid,
        )
        request.kv_transfer_params = params
        self.scheduler.add_request(request)
        return request

    def run_worker(
        self, meta: TenantKVConnectorMetadata, *, compute: bool = False, hooks: bool = True
    ) -> set[int]:
        """One forward pass on the worker side: loads layer by layer, and (``compute``) fresh
        KV written into every scheduled page and saved. Returns the pages whose load failed.
        ``hooks=False``: the model never asks for its layers (the loads cannot complete)."""
        self.worker.bind_connector_metadata(meta)
        self.worker.handle_preemptions(meta)
        self.worker.start_load_kv(SimpleNamespace(no_compile_layers={}))
        for index, name in enumerate(LAYERS):
            if hooks:
                self.worker.wait_for_layer_load(name)
            if compute:
                for save in meta.saves:
                    for block in save.block_ids:
                        self.pages[name][block] = float(index + 1) + block
            self.worker.save_kv_layer(name, self.pages[name], None)
        self.worker.wait_for_save()
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        return errors

    def step(
        self,
        *,
        compute: bool = False,
        finished_recving: set[str] | None = None,
        drain: bool = True,
    ) -> Any:
        """One scheduler step and its forward pass; ``drain``: wait for the step's background
        saves before reporting (deterministic tests; ``drain=False`` leaves them running)."""
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        assert isinstance(meta, TenantKVConnectorMetadata)
        errors = self.run_worker(meta, compute=compute)
        if drain:
            self.worker.worker_side.saves.drain()
        sending, done = self.worker.get_finished(set(output.finished_req_ids))
        recving = set(done or ()) | set(finished_recving or ())
        req_ids = [r.req_id for r in output.scheduled_new_reqs] + list(
            output.scheduled_cached_reqs.req_ids
        )
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[7] for _ in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving or None,
                invalid_block_ids=errors,
                kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
            ),
        )
        self.scheduler.update_from_output(output, runner)
        return output, meta, errors


def store_for(setup: Setup, tenant: str, scope: str | None = None) -> torch.Tensor:
    """Store the prompt's first 3 blocks for ``tenant``; returns the K|V rows per layer
    (token ``t``'s row ``[HEADS, 2 * HEAD_DIM]``). The connector's namespaces keep MHA layers
    as vLLM's pages (``mha-pages``): each layer is stored as 3 pages ``[HEADS, BLOCK, K|V]``."""
    namespace = setup.connector.engine.namespace(RequestTenant(tenant, scope))
    assert namespace is not None
    assert namespace.layout.kind == "mha-pages"
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(len(LAYERS), 96, HEADS, 2 * HEAD_DIM, generator=generator)
    layers = [
        rows[i].view(3, BLOCK, HEADS, 2 * HEAD_DIM).permute(0, 2, 1, 3).contiguous()
        for i in range(len(LAYERS))
    ]
    assert namespace.store(PROMPT[:96], layers) == 96
    return rows


def params(gateway: AssertionSigner, tenant: str, **claims: Any) -> dict[str, Any]:
    return {"tenantkv_assertion": gateway.sign(tenant, **claims)}


@pytest.fixture
def setup(
    request: pytest.FixtureRequest, tmp_path: Path, index: Index, tiny_llama: Path, gateway_pem: str
) -> Setup:
    """Layer-wise loads, or (parametrized ``indirect``) the ``layer_wise`` setting given."""
    layer_wise = getattr(request, "param", True)
    return Setup(tmp_path / "cache", index, tiny_llama, gateway_pem, layer_wise=layer_wise)


@pytest.fixture
def async_setup(tmp_path: Path, index: Index, tiny_llama: Path, gateway_pem: str) -> Setup:
    """Asynchronous loads (``load_async``): a hit loads between steps, off the forward."""
    return Setup(tmp_path / "cache", index, tiny_llama, gateway_pem, load_async=True)


#: Run a test with loads layer by layer and with whole loads before the forward.
BOTH_LOAD_MODES = pytest.mark.parametrize(
    "setup", [True, False], ids=["layer-wise", "before-forward"], indirect=True
)


@BOTH_LOAD_MODES
def test_matched_tokens_loaded_into_pages_through_the_block_ids(
    setup: Setup, gateway: AssertionSigner
) -> None:
    rows = store_for(setup, "acme")
    usage_before = dict(setup.kv.usage("acme").counters)
    owner = setup.request("owner", params(gateway, "acme"))
    # asked repeatedly, the scheduler-side lookup is side-effect free (no metering)
    for _ in range(3):
        assert setup.connector.get_num_new_matched_tokens(owner, 0) == (96, False)
    assert setup.kv.usage("acme").counters == usage_before
    _, meta, errors = setup.step(compute=True)
    assert errors == set()
    assert owner.num_computed_tokens == 100  # 96 loaded + 4 computed
    (load,) = meta.loads
    assert (load.first_block, len(load.block_ids)) == (0, 3)
    for index, name in enumerate(LAYERS):
        for b, page in enumerate(load.block_ids):
            expected = rows[index, b * BLOCK : (b + 1) * BLOCK].permute(1, 0, 2)
            assert torch.equal(setup.pages[name][page], expected), (name, b)
    assert meta.saves == []  # everything the prompt has in full blocks was cached
    setup.scheduler.finish_requests("owner", RequestStatus.FINISHED_ABORTED)
    totals = setup.kv.usage("acme").counters
    assert totals["hit_tokens"] - usage_before.get("hit_tokens", 0) == 96  # metered at the end
    assert totals["miss_tokens"] - usage_before.get("miss_tokens", 0) == 4


def store_latent_for(setup: Setup, tenant: str) -> torch.Tensor:
    """Store the prompt's first 3 blocks of latent rows for ``tenant`` (an MLA setup);
    returns them, ``[layers, 96, LATENT]``: a page holds its block's rows as they are."""
    namespace = setup.connector.engine.namespace(RequestTenant(tenant, None))
    assert namespace is not None
    assert namespace.layout.kind == "mla"
    rows = torch.randn(len(LAYERS), 96, LATENT, generator=torch.Generator().manual_seed(2))
    assert namespace.store(PROMPT[:96], list(rows)) == 96
    return rows


def check_a_load_after_vllms_local_hit(
    setup: Setup,
    gateway: AssertionSigner,
    monkeypatch: pytest.MonkeyPatch,
    *,
    into_pages: bool = True,
) -> None:
    """A request whose first block vLLM's own prefix cache holds (the tenant's salt) loads
    only the blocks after it (``skip_blocks``): nothing decrypted to be thrown away, and the
    shared page left as vLLM has it. ``into_pages``: whether the load can decrypt straight into
    the pages (else the connector copies each loaded layer into the blocks after vLLM's)."""
    mla = setup.connector.engine.layout.kind == "mla"
    rows = store_latent_for(setup, "acme") if mla else store_for(setup, "acme")

    def stored_page(layer: int, b: int) -> torch.Tensor:
        """What the page of the prompt's block ``b`` must hold in layer ``layer``."""
        block = rows[layer, b * BLOCK : (b + 1) * BLOCK]
        return block if mla else block.permute(1, 0, 2)

    loads: list[tuple[int, bool]] = []
    load = Namespace.load

    def recorded(self: Namespace, *args: Any, **kwargs: Any) -> Any:
        loads.append((kwargs.get("skip_blocks", 0), kwargs.get("out") is not None))
        return load(self, *args, **kwargs)

    monkeypatch.setattr(Namespace, "load", recorded)

    def loaded(request: Request) -> Any:
        """Step until ``request`` runs; its one load's spec (an async load runs between)."""
        specs = []
        for _ in range(4):
            _, meta, errors = setup.step()
            assert errors == set()
            specs += meta.loads
            setup.worker.worker_side._async_pool.submit(lambda: None).result()
            if specs and request.status == RequestStatus.RUNNING:
                break
        (spec,) = specs
        return spec

    # a first turn of one block and a few tokens: block 0 comes from tenantkv (control: a
    # request vLLM's cache does not cover loads from the first block), then stays in vLLM's
    # prefix cache under the tenant's salt
    spec = loaded(setup.request("first", params(gateway, "acme"), prompt=PROMPT[:40], salt="acme"))
    assert spec.first_block == 0 and loads == [(0, into_pages)]
    shared = spec.block_ids[0]
    for index, name in enumerate(LAYERS):
        assert torch.equal(setup.pages[name][shared], stored_page(index, 0)), name
        setup.pages[name][shared] = -1.0  # vLLM's own values, which no load may overwrite
    setup.scheduler.finish_requests("first", RequestStatus.FINISHED_ABORTED)
    turn = setup.request("second", params(gateway, "acme"), salt="acme")
    spec = loaded(turn)
    assert spec.first_block == 1 and spec.block_ids[0] == shared
    assert turn.num_computed_tokens >= 96  # 32 from vLLM, 64 loaded
    assert loads[1:] == [(1, into_pages)]  # only the blocks after vLLM's are read
    for index, name in enumerate(LAYERS):
        assert bool((setup.pages[name][shared] == -1.0).all()), name
        for b, page in enumerate(spec.block_ids[1:], start=1):
            assert torch.equal(setup.pages[name][page], stored_page(index, b)), (name, b)


@BOTH_LOAD_MODES
def test_blocks_vllms_prefix_cache_holds_are_neither_loaded_nor_rewritten(
    setup: Setup, gateway: AssertionSigner, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_a_load_after_vllms_local_hit(setup, gateway, monkeypatch)


def test_an_async_load_after_vllms_local_hit_skips_its_blocks_too(
    async_setup: Setup, gateway: AssertionSigner, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_a_load_after_vllms_local_hit(async_setup, gateway, monkeypatch)


@pytest.mark.parametrize(  # MHA into the pages: the two tests above
    ("mla", "strided_pages"),
    [(True, False), (False, True), (True, True)],
    ids=["mla-into-pages", "mha-copied", "mla-copied"],
)
def test_a_load_after_vllms_local_hit_fills_the_right_pages_in_either_layout_and_path(
    tmp_path: Path,
    index: Index,
    tiny_llama: Path,
    tiny_deepseek: Path,
    gateway_pem: str,
    gateway: AssertionSigner,
    monkeypatch: pytest.MonkeyPatch,
    mla: bool,
    strided_pages: bool,
) -> None:
    """The blocks after vLLM's local hit land in their own pages for MLA's latent pages as for
    MHA's, whether the load decrypts into the pages or the connector copies each loaded layer
    in (pages a row does not lie whole in: the loaded layer starts after vLLM's blocks, and is
    written from the request's second page on)."""
    setup = Setup(
        tmp_path / "cache",
        index,
        tiny_deepseek if mla else tiny_llama,
        gateway_pem,
        mla=mla,
        strided_pages=strided_pages,
        mla_prefix_cache=mla,
    )
    check_a_load_after_vllms_local_hit(setup, gateway, monkeypatch, into_pages=not strided_pages)


def test_other_tenants_scopes_and_bad_assertions_match_nothing(
    setup: Setup, gateway: AssertionSigner
) -> None:
    store_for(setup, "acme", scope="u1")
    expired = gateway.sign("acme", scope="u1", ttl=1)
    time.sleep(1.1)
    others = {
        "globex": params(gateway, "globex", scope="u1"),
        "acme-u2": params(gateway, "acme", scope="u2"),
        "salt-only": {"cache_salt": "acme"},
        "none": None,
        "forged": {"tenantkv_assertion": expired[:-4] + "AAAA"},
        "expired": {"tenantkv_assertion": expired},
    }
    # the owner first: one step's 512-token budget takes 5 of these 100-token prompts
    requests = {"owner": setup.request("owner", params(gateway, "acme", scope="u1"))}
    requests.update({rid: setup.request(rid, p) for rid, p in others.items()})
    _, meta, _ = setup.step(compute=True)
    assert [load.request_id for load in meta.loads] == ["owner"]  # the positive control
    assert requests["owner"].num_computed_tokens == 100
    _, later, _ = setup.step(compute=True)
    assert later.loads == []
    meta.saves.extend(later.saves)
    # a refused assertion: one security event per request, however often it is polled
    assert setup.kv.security_events()[ASSERTION_REFUSED] == 4
    # tenants with a verified assertion store their own copy; refused requests store nothing
    saved = {save.request_id for save in meta.saves}
    assert saved == {"globex", "acme-u2"}


def test_a_cache_error_is_a_counted_miss_never_an_exception_in_the_scheduler(
    setup: Setup, gateway: AssertionSigner
) -> None:
    store_for(setup, "acme")
    errors_before = setup.kv.context.health.counts().get(ENGINE_ERRORS, 0)
    owner = setup.request("owner", params(gateway, "acme"))
    # verified owners, prompts tenantkv refuses (InvalidRequestError: ids outside [0, 2**32))
    bad = {
        rid: setup.request(rid, params(gateway, "acme"), [*PROMPT[:10], token, *PROMPT[11:]])
        for rid, token in (("negative", -1), ("too-large", 2**40))
    }
    _, meta, errors = setup.step(compute=True)  # the scheduler's step does not raise
    assert errors == set()
    # positive control: the owner's request in the same step loads its prefix
    assert [load.request_id for load in meta.loads] == ["owner"]
    assert owner.num_computed_tokens == 100
    # the refused prompts are computed as without a cache: nothing loaded, nothing saved
    assert all(request.num_computed_tokens == 100 for request in bad.values())
    assert not {save.request_id for save in meta.saves} & set(bad)
    assert setup.kv.context.health.counts()[ENGINE_ERRORS] == errors_before + 2  # counted
    setup.step()  # asked again, they stay misses, counted once each
    assert setup.kv.context.health.counts()[ENGINE_ERRORS] == errors_before + 2
    for rid in ("owner", *bad):
        setup.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)


def test_computed_prompt_is_saved_and_then_hits(setup: Setup, gateway: AssertionSigner) -> None:
    setup.request("first", params(gateway, "globex"))
    _, meta, _ = setup.step(compute=True)
    (save,) = meta.saves
    assert (save.start_block, len(save.block_ids)) == (0, 3)
    setup.scheduler.finish_requests("first", RequestStatus.FINISHED_ABORTED)
    saved_pages = {name: setup.pages[name][list(save.block_ids)].clone() for name in LAYERS}
    for name in LAYERS:
        setup.pages[name].zero_()
    setup.scheduler.reset_prefix_cache()
    second = setup.request("second", params(gateway, "globex"))
    _, meta, _ = setup.step()
    (load,) = meta.loads
    assert second.num_computed_tokens == 100
    for name in LAYERS:
        assert torch.equal(setup.pages[name][list(load.block_ids)], saved_pages[name])


def test_async_load_finishes_between_steps(async_setup: Setup, gateway: AssertionSigner) -> None:
    setup = async_setup
    store_for(setup, "acme")
    request = setup.request("owner", params(gateway, "acme"))
    assert setup.connector.get_num_new_matched_tokens(request, 0) == (96, True)
    _, meta, _ = setup.step()
    assert [load.asynchronous for load in meta.loads] == [True]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    setup.worker.worker_side._async_pool.submit(lambda: None).result()  # the load has run
    for _ in range(3):
        setup.step()
    assert request.status == RequestStatus.RUNNING
    assert request.num_computed_tokens >= 100


@BOTH_LOAD_MODES
def test_preempted_request_loads_again_into_its_new_pages(
    setup: Setup, gateway: AssertionSigner
) -> None:
    rows = store_for(setup, "acme")
    request = setup.request("owner", params(gateway, "acme"))
    _, first, _ = setup.step()
    for name in LAYERS:
        setup.pages[name].zero_()
    assert setup.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert request.status == RequestStatus.PREEMPTED
    _, again, errors = setup.step()
    (load,) = again.loads
    assert load.request_id == "owner" and errors == set() and len(first.loads) == 1
    # the resumed request (prompt + 1 sampled token) loaded its 96 tokens again
    assert load.token_ids == tuple(PROMPT[:96]) and load.first_block == 0
    assert request.status == RequestStatus.RUNNING and request.num_computed_tokens == 101
    page = load.block_ids[2]
    assert torch.equal(setup.pages[LAYERS[1]][page], rows[1, 64:96].permute(1, 0, 2))


@BOTH_LOAD_MODES
def test_damaged_extent_is_reported_and_recomputed(setup: Setup, gateway: AssertionSigner) -> None:
    store_for(setup, "acme")
    for path in (setup.root / "blocks").rglob("*"):
        if path.is_file() and path.stat().st_size > 4096:
            data = bytearray(path.read_bytes())
            data[-100] ^= 0xFF  # inside the last layer's last segment
            path.write_bytes(bytes(data))
    request = setup.request("owner", params(gateway, "acme"))
    _, meta, errors = setup.step()
    (load,) = meta.loads
    assert errors == set(load.block_ids)  # reported, so vLLM recomputes them
    assert request.num_computed_tokens == 0  # rolled back to the first failed block
    assert setup.kv.security_events().get("segment_open_failed", 0) >= 1
    # the extent was dropped: the next lookup misses, and the recomputed prompt is saved again
    _, meta, errors = setup.step(compute=True)
    assert errors == set() and meta.loads == []
    assert [save.request_id for save in meta.saves] == ["owner"]


def test_load_never_asked_for_is_reported_not_left_half_done(
    setup: Setup, gateway: AssertionSigner
) -> None:
    store_for(setup, "acme")
    setup.request("owner", params(gateway, "acme"))
    output = setup.scheduler.schedule()
    meta = output.kv_connector_metadata
    (load,) = meta.loads
    errors = setup.run_worker(meta, hooks=False)
    assert errors == set(load.block_ids)  # vLLM recomputes them instead of reading zeros


def test_the_connectors_cache_keeps_a_longer_window_unless_told(
    setup: Setup, gateway_pem: str
) -> None:
    plain = ConnectorSettings.from_extra_config(
        {"root": "r", "gateway_public_keys": [gateway_pem]}, "m"
    )
    library_default = TenantKVConfig().read_ahead  # one per core, at least 2
    assert plain.open_options["window"] == max(ENGINE_WINDOW, library_default)
    told = ConnectorSettings.from_extra_config(
        {"root": "r", "gateway_public_keys": [gateway_pem], "open_options": {"window": 3}}, "m"
    )
    assert told.open_options["window"] == 3  # an operator's own window wins
    assert setup.kv.context.runtime.window == max(ENGINE_WINDOW, library_default)  # in use


# ---- background saves --------------------------------------------------------------------------


def gate_saves(setup: Setup) -> threading.Event:
    """Hold the worker's background saves until the returned event is set (the real store runs
    after it): a save stays in flight as long as a test needs."""
    saves = setup.worker.worker_side.saves
    real = saves._store
    gate = threading.Event()

    def gated(job: Any) -> None:
        assert gate.wait(60), "the test never released the saves"
        real(job)

    saves._store = gated
    return gate


def free_blocks(setup: Setup) -> int:
    return int(setup.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def test_a_save_in_flight_keeps_the_finished_requests_pages_until_done(
    setup: Setup, gateway: AssertionSigner
) -> None:
    gate = gate_saves(setup)
    setup.request("first", params(gateway, "globex"))
    _, meta, _ = setup.step(compute=True, drain=False)
    (save,) = meta.saves
    expected = {name: setup.pages[name][list(save.block_ids)].clone() for name in LAYERS}
    setup.scheduler.finish_requests("first", RequestStatus.FINISHED_ABORTED)
    held = free_blocks(setup)
    # the next turn of the conversation waits for the save instead of computing the prompt
    second = setup.request("second", params(gateway, "globex"))
    for _ in range(2):
        setup.step(drain=False)
        assert setup.worker.worker_side.saves.in_flight("first")
        assert "first" in setup.scheduler.requests  # vLLM still holds its pages
        assert free_blocks(setup) == held
        assert second.status == RequestStatus.WAITING and second.num_computed_tokens == 0
    gate.set()
    setup.worker.worker_side.saves.drain()
    _, meta, _ = setup.step()  # reports "first" finished sending, and its save done
    assert "first" not in setup.scheduler.requests
    assert meta.loads == []  # the save was reported in this step's output: next step loads
    _, meta, _ = setup.step()
    (load,) = meta.loads  # positive control: the owner's next turn hits what was saved
    assert second.num_computed_tokens == 100
    for name in LAYERS:
        assert torch.equal(setup.pages[name][list(load.block_ids)], expected[name])
    assert setup.worker.worker_side.saves.failed == 0


def test_a_next_turn_that_vllms_prefix_cache_covers_does_not_wait_for_the_save(
    setup: Setup, gateway: AssertionSigner
) -> None:
    gate = gate_saves(setup)
    setup.request("first", params(gateway, "globex"), salt="globex")
    setup.step(compute=True, drain=False)
    setup.scheduler.finish_requests("first", RequestStatus.FINISHED_ABORTED)
    # the same tenant's next turn: vLLM's prefix cache (the gateway's per-tenant salt) still
    # holds the first turn's pages, so the save could add nothing and the request runs now
    turn = setup.request("second", params(gateway, "globex"), salt="globex")
    # control: a request vLLM's cache does not cover still waits for the save to load from it
    uncovered = setup.request("third", params(gateway, "globex"), salt="elsewhere")
    setup.step(drain=False)
    assert setup.worker.worker_side.saves.in_flight("first")
    assert turn.status == RequestStatus.RUNNING and turn.num_computed_tokens >= 96
    assert uncovered.status == RequestStatus.WAITING and uncovered.num_computed_tokens == 0
    gate.set()
    setup.worker.worker_side.saves.drain()
    for _ in range(2):
        _, meta, _ = setup.step()
        if meta.loads:
            break
    (load,) = meta.loads  # positive control: the uncovered request hits the saved prefix
    assert load.request_id == "third" and uncovered.num_computed_tokens >= 96
    assert setup.worker.worker_side.saves.failed == 0


def record_yields(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The sleeps of the connector's scheduler side from now on (they still sleep)."""
    slept: list[float] = []
    real_sleep = time.sleep

    def recorded(seconds: float) -> None:
        if sys._getframe(1).f_globals.get("__name__") == scheduler_side.__name__:
            slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(scheduler_side.time, "sleep", recorded)
    return slept


def test_an_idle_step_that_holds_a_request_for_a_save_gives_the_save_the_gil(
    setup: Setup, gateway: AssertionSigner, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept = record_yields(monkeypatch)
    gate = gate_saves(setup)
    setup.request("first", params(gateway, "globex"))
    setup.step(compute=True, drain=False)
    setup.scheduler.finish_requests("first", RequestStatus.FINISHED_ABORTED)
    setup.step(drain=False)
    assert slept == []  # steps that ran a prompt, or held nothing, go on at once
    second = setup.request("second", params(gateway, "globex"))
    setup.step(drain=False)  # the next turn is held for the save and nothing else runs
    assert slept == [scheduler_side.BACKGROUND_YIELD]
    assert second.status == RequestStatus.WAITING
    gate.set()
    setup.worker.worker_side.saves.drain()
    setup.step()  # reports the save done
    _, meta, _ = setup.step()
    (load,) = meta.loads  # positive control: the held turn loads what was saved
    assert load.request_id == "second" and second.num_computed_tokens == 100
    assert len(slept) == 2  # the step that reported the save still held the request


def test_idle_steps_while_an_async_load_runs_give_it_the_gil(
    async_setup: Setup, gateway: AssertionSigner, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = async_setup
    store_for(setup, "acme")
    slept = record_yields(monkeypatch)
    started = threading.Event()
    release = threading.Event()
    pool = setup.worker.worker_side._async_pool
    pool.submit(lambda: (started.set(), release.wait(60)))  # the load queues behind this
    assert started.wait(10)
    request = setup.request("owner", params(gateway, "acme"))
    for _ in range(2):
        setup.step()
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert slept == [scheduler_side.BACKGROUND_YIELD] * 2  # nothing else to run: yield
    release.set()
    pool.submit(lambda: None).result()  # the load has run
    for _ in range(3):
        setup.step()
    # positive control: the load finished and the request ran, with no yield once it did
    assert request.status == RequestStatus.RUNNING and request.num_computed_tokens >= 100
    assert 2 <= len(slept) <= 3


def test_a_failed_background_save_is_counted_and_leaves_nothing_indexed(
    setup: Setup, gateway: AssertionSigner
) -> None:
    blocks = setup.root / "blocks"
    blocks.mkdir(exist_ok=True)
    before = {p for p in blocks.rglob("*") if p.is_file()}
    aside = setup.root / "blocks.aside"
    gate = gate_saves(setup)
    setup.request("first", params(gateway, "globex"))
    setup.step(compute=True, drain=False)
    blocks.rename(aside)
    blocks.write_bytes(b"")  # the block store's directory is gone (a lost mount)
    degraded = setup.kv.health_counters().get("degraded_store", 0)
    gate.set()
    setup.step()
    assert setup.kv.health_counters().get("degraded_store", 0) == degraded + 1  # counted
    blocks.unlink()
    aside.rename(blocks)
    assert {p for p in blocks.rglob("*") if p.is_file()} == before  # no partial extent
    namespace = setup.connector.engine.namespace(RequestTenant("globex", None))
    assert namespace is not None and namespace.cached_length(PROMPT[:96]) == 0
    # positive control: the same prompt saves once the store is back, and then hits
    setup.request("again", params(gateway, "globex"))
    _, meta, _ = setup.step(compute=True)
    assert [s.request_id for s in meta.saves] == ["again"]
    assert namespace.cached_length(PROMPT[:96]) == 96


def test_back_pressure_bounds_the_bytes_of_queued_saves(
    setup: Setup, gateway: AssertionSigner
) -> None:
    saves = setup.worker.worker_side.saves
    job_bytes = 3 * BLOCK * 2 * HEADS * HEAD_DIM * 4 * len(LAYERS)  # 3 blocks, K and V, fp32
    saves.max_bytes = 2 * job_bytes
    gate = gate_saves(setup)
    prompts = [[p + 1000 * i for p in PROMPT] for i in range(4)]
    for i, prompt in enumerate(prompts):
        setup.request(f"r{i}", params(gateway, "acme"), prompt)
    stepping = threading.Thread(target=lambda: setup.step(compute=True, drain=False))
    stepping.start()
    stepping.join(1.0)
    assert stepping.is_alive()  # the step waits: two saves queued fill the bound
    assert saves.peak_pending_bytes == 2 * job_bytes
    gate.set()
    stepping.join(60)
    assert not stepping.is_alive()
    saves.drain()
    assert saves.peak_pending_bytes <= saves.max_bytes and saves.completed == 4
    namespace = setup.connector.engine.namespace(RequestTenant("acme", None))
    assert namespace is not None
    assert [namespace.cached_length(p[:96]) for p in prompts] == [96] * 4  # all stored


def test_a_preempted_requests_save_finishes_before_the_next_step_reuses_its_pages(
    setup: Setup, gateway: AssertionSigner
) -> None:
    gate = gate_saves(setup)
    request = setup.request("first", params(gateway, "globex"))
    _, meta, _ = setup.step(compute=True, drain=False)
    (save,) = meta.saves
    expected = {name: setup.pages[name][list(save.block_ids)].clone() for name in LAYERS}
    assert setup.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert request.status == RequestStatus.PREEMPTED  # vLLM freed its pages, unasked
    stepping = threading.Thread(target=lambda: setup.step(compute=True, drain=False))
    stepping.start()
    stepping.join(1.0)
    assert stepping.is_alive()  # handle_preemptions waits for the save before the forward
    assert setup.worker.worker_side.saves.in_flight("first")
    gate.set()
    stepping.join(60)
    assert not stepping.is_alive()
    # the save read the pages as the first step left them, not what the next step wrote
    namespace = setup.connector.engine.namespace(RequestTenant("globex", None))
    assert namespace is not None and namespace.cached_length(PROMPT[:96]) == 96
    with namespace.load(PROMPT[:96]) as stream:
        for index, layer in stream:  # the pages as they were stored
            assert torch.equal(layer, expected[LAYERS[index]])


@pytest.mark.parametrize("codec", ["fp8", "int4"])
def test_a_coded_namespace_loads_decoded_values_into_the_pages(
    tmp_path: Path,
    index: Index,
    tiny_llama: Path,
    gateway_pem: str,
    gateway: AssertionSigner,
    codec: str,
) -> None:
    """The connector takes ``codec`` from its extra config: what it stores is coded, and a hit
    puts exactly what the codec decodes into the engine's pages (not the stored values: the
    codec is lossy); a connector without the codec is another namespace and misses."""
    setup = Setup(tmp_path / "cache", index, tiny_llama, gateway_pem, codec=codec)
    assert setup.connector.engine.layout.codec == codec
    rows = store_for(setup, "acme")
    owner = setup.request("owner", params(gateway, "acme"))
    assert setup.connector.get_num_new_matched_tokens(owner, 0) == (96, False)
    _, meta, errors = setup.step(compute=True)
    assert errors == set()
    (load,) = meta.loads
    layout = setup.connector.engine.layout
    for index_, name in enumerate(LAYERS):
        # what store_for stored: the layer's 3 pages [HEADS, BLOCK, K|V], as their bytes
        pages = rows[index_].view(3, BLOCK, HEADS, 2 * HEAD_DIM).permute(0, 2, 1, 3)
        stored = pages.contiguous().view(torch.uint8).view(96, -1)
        coded = layout.decode_rows(layout.encode_rows(stored, BLOCK), BLOCK)
        decoded = coded.view(torch.float32).view(3, HEADS, BLOCK, 2 * HEAD_DIM)
        assert not torch.equal(decoded, pages)
        for b, page in enumerate(load.block_ids):
            assert torch.equal(setup.pages[name][page], decoded[b]), (name, b)
    plain = Setup(tmp_path / "cache", index, tiny_llama, gateway_pem)
    other = plain.request("plain", params(gateway, "acme"))
    assert plain.connector.get_num_new_matched_tokens(other, 0) == (0, False)


# ---- the engine's layout, read once ------------------------------------------------------------


def count_index_builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Record every index tensor built from a request's block ids (the real one is built)."""
    built: list[tuple[int, ...]] = []
    real = paged_kv.block_index

    def counting(block_ids: Any, device: torch.device) -> torch.Tensor:
        built.append(tuple(block_ids))
        return real(block_ids, device)

    monkeypatch.setattr(paged_kv, "block_index", counting)
    return built


@pytest.mark.parametrize("max_runs", [0, paged_kv.MAX_SLICED_RUNS])
def test_a_load_and_a_save_work_out_the_requests_pages_once_for_every_layer(
    setup: Setup, gateway: AssertionSigner, monkeypatch: pytest.MonkeyPatch, max_runs: int
) -> None:
    """Indexed (``max_runs=0``): one index tensor per request, whatever the number of layers;
    sliced (vLLM's consecutive pages): none at all. The load builds none either way: its
    layers are stored as the pages (``mha-pages``) and decrypted straight into them. Every
    other page keeps what it held, and the pages hold exactly the stored rows."""
    monkeypatch.setattr(paged_kv, "MAX_SLICED_RUNS", max_runs)
    built = count_index_builds(monkeypatch)
    rows = store_for(setup, "acme")
    for name in LAYERS:
        setup.pages[name].fill_(-7.0)  # what other requests' pages hold
    setup.request("owner", params(gateway, "acme"))
    setup.request("saver", params(gateway, "globex"))
    _, meta, errors = setup.step(compute=True)
    assert errors == set()
    (load,) = meta.loads
    (save,) = meta.saves
    assert len(LAYERS) > 1
    assert built == ([] if max_runs else [save.block_ids])  # the load: into the pages
    written = set(load.block_ids) | set(save.block_ids)
    for index, name in enumerate(LAYERS):
        for b, page in enumerate(load.block_ids):
            expected = rows[index, b * BLOCK : (b + 1) * BLOCK].permute(1, 0, 2)
            assert torch.equal(setup.pages[name][page], expected), (name, b)
        untouched = [p for p in range(NUM_BLOCKS) if p not in written]
        assert bool((setup.pages[name][untouched] == -7.0).all()), name
    # the save gathered the saver's pages: its next turn loads them back unchanged
    namespace = setup.connector.engine.namespace(RequestTenant("globex", None))
    assert namespace is not None
    with namespace.load(PROMPT[:96]) as stream:
        for index, layer in stream:  # the pages as they were stored
            expected = setup.pages[LAYERS[index]][list(save.block_ids)]
            assert torch.equal(layer, expected)


@BOTH_LOAD_MODES
def test_pages_of_the_wrong_shape_are_refused_at_registration_and_in_a_step(
    setup: Setup, gateway: AssertionSigner
) -> None:
    wrong = {name: torch.zeros(NUM_BLOCKS, HEADS + 1, BLOCK, 2 * HEAD_DIM) for name in LAYERS}
    fresh = TenantKVConnector(setup.config, KVConnectorRole.WORKER, kv_cache_config())
    with pytest.raises(InvalidRequestError, match="does not match the layout"):
        fresh.register_kv_caches(wrong)
    fresh.shutdown()
    # a step that hands pages of another shape: its loads are reported (vLLM recomputes
    # them), nothing is written, and the step itself goes on
    rows = store_for(setup, "acme")
    setup.request("owner", params(gateway, "acme"))
    output = setup.scheduler.schedule()
    meta = output.kv_connector_metadata
    (load,) = meta.loads
    layers = {name: SimpleNamespace(kv_cache=wrong[name]) for name in LAYERS}
    worker = setup.worker
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace(no_compile_layers=layers))
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set(load.block_ids)
    worker.clear_connector_metadata()
    assert all(t.abs().sum() == 0 for t in wrong.values())
    assert all(t.abs().sum() == 0 for t in setup.pages.values())
    # positive control: the registered pages again, and the next load lands
    worker.bind_connector_metadata(meta)
    layers = {name: SimpleNamespace(kv_cache=setup.pages[name]) for name in LAYERS}
    worker.start_load_kv(SimpleNamespace(no_compile_layers=layers))
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    assert worker.get_block_ids_with_load_errors() == set()
    worker.clear_connector_metadata()
    page = load.block_ids[0]
    assert torch.equal(setup.pages[LAYERS[0]][page], rows[0, :BLOCK].permute(1, 0, 2))


@pytest.mark.parametrize("layer_wise", [True, False], ids=["layer-wise", "before-forward"])
def test_an_mla_load_decrypts_straight_into_the_pages(
    tmp_path: Path,
    index: Index,
    tiny_deepseek: Path,
    gateway_pem: str,
    gateway: AssertionSigner,
    monkeypatch: pytest.MonkeyPatch,
    layer_wise: bool,
) -> None:
    """MLA pages hold a token's row as tenantkv stores it: the load writes the pages itself
    (no layer tensor, no copy by the connector), only the request's pages; a load that fails
    there is still reported for recomputation."""
    setup = Setup(
        tmp_path / "cache", index, tiny_deepseek, gateway_pem, mla=True, layer_wise=layer_wise
    )
    assert setup.connector.engine.layout.kind == "mla"
    copies: list[str] = []
    real_write = paged_kv.PagedLayer.write

    def counting_write(self: Any, blocks: Any, layer: Any) -> None:
        copies.append("write")
        real_write(self, blocks, layer)

    monkeypatch.setattr(paged_kv.PagedLayer, "write", counting_write)
    blocks_dir = setup.root / "blocks"
    stored: dict[str, torch.Tensor] = {}
    extents: dict[str, set[Path]] = {}
    for tenant in ("acme", "globex"):
        namespace = setup.connector.engine.namespace(RequestTenant(tenant, None))
        assert namespace is not None
        before = {p for p in blocks_dir.rglob("*") if p.is_file()} if blocks_dir.exists() else set()
        generator = torch.Generator().manual_seed(len(stored) + 3)
        stored[tenant] = torch.randn(len(LAYERS), 96, LATENT, generator=generator)
        assert namespace.store(PROMPT[:96], list(stored[tenant])) == 96
        extents[tenant] = {p for p in blocks_dir.rglob("*") if p.is_file()} - before
    for name in LAYERS:
        setup.pages[name].fill_(-7.0)  # what other requests' pages hold
    setup.request("owner", params(gateway, "acme"))
    _, meta, errors = setup.step()
    assert errors == set()
    (load,) = meta.loads
    assert load.first_block == 0 and len(load.block_ids) == 3
    assert copies == []  # the stream wrote the pages
    for index_, name in enumerate(LAYERS):
        for b, page in enumerate(load.block_ids):
            expected = stored["acme"][index_, b * BLOCK : (b + 1) * BLOCK]
            assert torch.equal(setup.pages[name][page], expected), (name, b)
        others = [p for p in range(NUM_BLOCKS) if p not in load.block_ids]
        assert bool((setup.pages[name][others] == -7.0).all()), name
    # globex's extent damaged in its last layer: reported, so vLLM recomputes those pages
    for path in extents["globex"]:
        if path.stat().st_size > 4096:
            data = bytearray(path.read_bytes())
            data[-100] ^= 0xFF
            path.write_bytes(bytes(data))
    setup.request("globex", params(gateway, "globex"))
    _, meta, errors = setup.step()
    (load,) = meta.loads
    assert errors == set(load.block_ids)
    assert setup.kv.security_events().get("segment_open_failed", 0) >= 1


# ---- a load before the forward or layer by layer -------------------------------------------------


@pytest.mark.parametrize("layer_wise", [True, False], ids=["layer-wise", "before-forward"])
def test_a_load_before_the_forward_fills_every_layer_in_start_load_kv(
    tmp_path: Path,
    index: Index,
    tiny_llama: Path,
    gateway_pem: str,
    gateway: AssertionSigner,
    layer_wise: bool,
) -> None:
    """``layer_wise=False``: when ``start_load_kv`` returns, every layer's pages hold the
    prefix, and the layer hooks have nothing left to do. Layer by layer (the control), the
    load is still open then, no layer waited for, and each layer is in its pages once its hook
    returns (the stream decrypts into the pages in the background, so a layer may be there
    sooner: the pages are not what tells the modes apart)."""
    setup = Setup(tmp_path / "cache", index, tiny_llama, gateway_pem, layer_wise=layer_wise)
    rows = store_for(setup, "acme")
    setup.request("owner", params(gateway, "acme"))
    meta = setup.scheduler.schedule().kv_connector_metadata
    (load,) = meta.loads
    worker = setup.worker

    def loaded(index_: int) -> bool:
        name = LAYERS[index_]
        return all(
            torch.equal(
                setup.pages[name][page],
                rows[index_, b * BLOCK : (b + 1) * BLOCK].permute(1, 0, 2),
            )
            for b, page in enumerate(load.block_ids)
        )

    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace(no_compile_layers={}))
    pending = worker.worker_side._loads
    if layer_wise:
        assert [(p.stream is not None, p.direct, p.written) for p in pending] == [(True, True, 0)]
    else:
        assert pending == [] and all(loaded(i) for i in range(len(LAYERS)))
    for index_, name in enumerate(LAYERS):
        worker.wait_for_layer_load(name)
        assert loaded(index_), name
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    worker.clear_connector_metadata()


def test_auto_loads_before_the_forward_only_where_the_forward_takes_every_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The "auto" rule: host-memory pages and torch's threads >= the process's CPUs (vLLM's
    CPU backend) load before the forward; fewer threads than CPUs, or pages on another
    device, stream layer by layer; so does an engine that registered no pages."""
    host = [torch.zeros(4, 2, BLOCK, 8)]
    threads = torch.get_num_threads()
    monkeypatch.setattr(worker_side, "usable_cpu_count", lambda: threads)
    assert worker_side.forward_takes_every_cpu(host)
    assert not worker_side.forward_takes_every_cpu([])
    assert not worker_side.forward_takes_every_cpu([torch.zeros(4, 2, BLOCK, 8, device="meta")])
    monkeypatch.setattr(worker_side, "usable_cpu_count", lambda: threads + 1)  # one left over
    assert not worker_side.forward_takes_every_cpu(host)


@pytest.mark.parametrize("spare_cpus, expected", [(0, False), (1, True)])
def test_the_connector_decides_auto_from_its_registered_pages(
    tmp_path: Path,
    index: Index,
    tiny_llama: Path,
    gateway_pem: str,
    monkeypatch: pytest.MonkeyPatch,
    spare_cpus: int,
    expected: bool,
) -> None:
    """``layer_wise = "auto"`` (the default) is decided when the engine registers its pages,
    and an explicit setting is kept whatever the pages."""
    cpus = torch.get_num_threads() + spare_cpus
    monkeypatch.setattr(worker_side, "usable_cpu_count", lambda: cpus)
    auto = Setup(tmp_path / "cache", index, tiny_llama, gateway_pem, layer_wise="auto")
    assert auto.worker.worker_side._layer_wise is expected
    told = Setup(tmp_path / "cache", index, tiny_llama, gateway_pem, layer_wise=not expected)
    assert told.worker.worker_side._layer_wise is (not expected)


@pytest.mark.parametrize("raw", ["yes", 1, None])
def test_a_bad_layer_wise_setting_is_refused(gateway_pem: str, raw: Any) -> None:
    extra = {"root": "r", "gateway_public_keys": [gateway_pem], "layer_wise": raw}
    with pytest.raises(InvalidRequestError, match="layer_wise"):
        ConnectorSettings.from_extra_config(extra, "m")
    del extra["layer_wise"]
    assert ConnectorSettings.from_extra_config(extra, "m").layer_wise is True  # the default
    for good, taken in (("auto", None), (True, True), (False, False)):
        extra["layer_wise"] = good
        assert ConnectorSettings.from_extra_config(extra, "m").layer_wise is taken
