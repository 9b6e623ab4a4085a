"""transformers integration: save a request's cache, restore the longest cached prefix, continue.

Real (tiny, randomly initialised) transformers models on CPU: DeepSeek-V3 (the MLA latent
cache), Llama (GQA) and Qwen2. Generation after a restore must be token-for-token the same as
after a full prefill; the negative control shows that the comparison does tell caches apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tenantkv  # noqa: E402
from tenantkv import InvalidRequestError, TenantKV  # noqa: E402
from tenantkv.integrations.transformers import (  # noqa: E402
    PrefixCache,
    layout_for,
    model_identity,
)

VOCAB = 512


def _deepseek(seed: int = 0, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "max_position_embeddings": 2048,
        "initializer_range": 0.2,
    }
    settings.update(overrides)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**settings))
    return model.eval()


def _llama(seed: int = 0, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "initializer_range": 0.2,
    }
    settings.update(overrides)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()


def _qwen2(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        initializer_range=0.2,
        use_sliding_window=False,
    )
    return transformers.Qwen2ForCausalLM(config).eval()


MODELS = {"deepseek_v3": _deepseek, "llama": _llama, "qwen2": _qwen2}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> Any:
    return MODELS[request.param]()


@pytest.fixture
def tenants(kv: TenantKV) -> TenantKV:
    kv.create_tenant("acme")
    kv.create_tenant("globex")
    return kv


def _prompt(length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, length), generator=generator)


def _generate(model: Any, ids: torch.Tensor, cache: Any = None, new: int = 12) -> Any:
    with torch.no_grad():
        return model.generate(
            ids,
            cache=cache,
            max_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
        )


def test_layouts_follow_the_model_config(model: Any) -> None:
    layout = layout_for(model)
    config = model.config
    assert layout.num_layers == config.num_hidden_layers
    assert layout.dtype == model.dtype
    if config.model_type == "deepseek_v3":
        assert (layout.kind, layout.kv_lora_rank, layout.rope_dim) == ("mla", 32, 16)
    else:
        heads = config.num_key_value_heads
        assert (layout.kind, layout.num_kv_heads, layout.head_dim) == ("mha", heads, 16)


@pytest.mark.parametrize("divergence", [None, 150])
def test_restore_then_generate_equals_full_prefill(
    tenants: TenantKV, model: Any, divergence: int | None
) -> None:
    """Full hit (the prompt extends the saved one) and partial hit (it diverges at 150)."""
    prefixes = PrefixCache(tenants, "acme", model)
    first = _prompt(260, seed=1)
    output = _generate(model, first)
    saved = prefixes.save(output.sequences, output.cache)
    # the cache holds 260 + 12 - 1 = 271 tokens: 4 full blocks
    assert saved == 256

    follow_up = torch.cat([output.sequences, _prompt(40, seed=2)], dim=1)
    if divergence is not None:
        follow_up[0, divergence:] = _prompt(follow_up.shape[1] - divergence, seed=3)[0]
    expected_hit = 256 if divergence is None else divergence // 64 * 64

    restored = prefixes.restore(follow_up)
    assert restored.num_tokens == expected_hit
    assert restored.cache is not None
    assert restored.cache.get_seq_length() == expected_hit

    after_restore = _generate(model, follow_up, cache=restored.cache, new=16).sequences
    full_prefill = _generate(model, follow_up, new=16).sequences
    assert torch.equal(after_restore, full_prefill)
    # The restored cache holds the saved bytes exactly. (Compared with the cache that was saved,
    # not with a new prefill's: a prefill of other length may round differently in the matmuls.)
    again = prefixes.restore(follow_up)
    assert again.num_tokens == expected_hit and again.cache is not None
    for saved_layer, restored_layer in zip(output.cache.layers, again.cache.layers, strict=True):
        assert torch.equal(restored_layer.keys, saved_layer.keys[..., :expected_hit, :])
        assert torch.equal(restored_layer.values, saved_layer.values[..., :expected_hit, :])


def test_negative_control_a_wrong_cache_changes_the_generation(tenants: TenantKV) -> None:
    """The identity check above can fail: a cache of other tokens gives another generation."""
    model = _deepseek()
    prefixes = PrefixCache(tenants, "acme", model)
    other = _prompt(200, seed=7)
    output = _generate(model, other)
    prefixes.save(output.sequences, output.cache)
    wrong = prefixes.restore(other)  # 192 cached tokens of `other`
    assert wrong.num_tokens == 192 and wrong.cache is not None

    prompt = _prompt(200, seed=8)
    with_wrong_cache = _generate(model, prompt, cache=wrong.cache, new=16).sequences
    assert not torch.equal(with_wrong_cache, _generate(model, prompt, new=16).sequences)


def test_restoring_across_tenants_scopes_and_models_misses(tenants: TenantKV) -> None:
    model = _deepseek()
    prompt = _prompt(200, seed=4)
    output = _generate(model, prompt)
    owner = PrefixCache(tenants, "acme", model, scope="user-1")
    assert owner.save(output.sequences, output.cache) == 192
    assert owner.restore(prompt).num_tokens == 192  # the positive control

    assert PrefixCache(tenants, "globex", model, scope="user-1").restore(prompt).num_tokens == 0
    assert PrefixCache(tenants, "acme", model, scope="user-2").restore(prompt).num_tokens == 0
    assert PrefixCache(tenants, "acme", model).restore(prompt).num_tokens == 0
    # Another architecture, hyper-parameter, dtype or revision: another namespace.
    deeper = _deepseek(num_hidden_layers=4)
    assert PrefixCache(tenants, "acme", deeper, scope="user-1").restore(prompt).num_tokens == 0
    other_theta = _deepseek(rope_theta=1234.0)
    assert PrefixCache(tenants, "acme", other_theta, scope="user-1").lookup(prompt) == 0
    bf16 = _deepseek().to(torch.bfloat16)
    assert PrefixCache(tenants, "acme", bf16, scope="user-1").lookup(prompt) == 0
    retrained = PrefixCache(tenants, "acme", model, scope="user-1", revision="fine-tune-2")
    assert retrained.lookup(prompt) == 0
    llama = _llama()
    assert PrefixCache(tenants, "acme", llama, scope="user-1").lookup(prompt) == 0
    # The same model loaded again (another object, another attention kernel) still hits.
    again = _deepseek()
    again.config._attn_implementation = "eager"
    assert PrefixCache(tenants, "acme", again, scope="user-1").lookup(prompt) == 192


def test_model_identity_carries_name_revision_and_config() -> None:
    model = _llama()
    name, label = model_identity(model)
    assert name == "llama"
    assert label.startswith("local+config-sha256:")
    assert model_identity(_llama(seed=5)) == (name, label)  # weights are not hashed
    assert model_identity(model, revision="abc123")[1].startswith("abc123+config-sha256:")
    assert model_identity(_llama(num_hidden_layers=3))[1] != label


def test_a_prompt_of_whole_blocks_leaves_its_last_token_to_compute(tenants: TenantKV) -> None:
    """The model must run at least one prompt token to produce logits for the next one."""
    model = _llama()
    prefixes = PrefixCache(tenants, "acme", model)
    prompt = _prompt(129, seed=5)
    output = _generate(model, prompt, new=1)
    assert prefixes.save(prompt, output.cache) == 128
    assert prefixes.restore(prompt[:, :128]).num_tokens == 64
    assert prefixes.lookup(prompt[:, :128]) == 64
    assert prefixes.restore(prompt).num_tokens == 128
    assert prefixes.restore(prompt[:, :64]).num_tokens == 0
    assert prefixes.restore([]).num_tokens == 0


def test_a_damaged_prefix_restores_as_a_miss_and_is_dropped(
    tenants: TenantKV, cache_root: Path
) -> None:
    model = _deepseek()
    prefixes = PrefixCache(tenants, "acme", model)
    prompt = _prompt(200, seed=6)
    output = _generate(model, prompt)
    prefixes.save(output.sequences, output.cache)
    assert prefixes.restore(prompt).num_tokens == 192  # control: intact, it hits
    extents = [p for p in (cache_root / "blocks").rglob("*") if p.is_file()]
    assert extents
    for path in extents:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))

    restored = prefixes.restore(prompt)
    assert (restored.num_tokens, restored.cache) == (0, None)
    assert tenants.security_events().get("segment_open_failed", 0) >= 1
    assert prefixes.lookup(prompt) == 0  # the damaged extent was dropped
    # generation goes on as a full prefill
    assert torch.equal(
        _generate(model, prompt, cache=restored.cache).sequences,
        _generate(model, prompt).sequences,
    )


def test_strict_mode_raises_on_a_damaged_prefix(cache_root: Path) -> None:
    with tenantkv.open(cache_root, durable=False, strict=True) as kv:
        kv.create_tenant("acme")
        model = _llama()
        prefixes = PrefixCache(kv, "acme", model)
        prompt = _prompt(140, seed=9)
        output = _generate(model, prompt)
        prefixes.save(output.sequences, output.cache)
        for path in (cache_root / "blocks").rglob("*"):
            if path.is_file():
                data = bytearray(path.read_bytes())
                data[-5] ^= 0xFF
                path.write_bytes(bytes(data))
        with pytest.raises(tenantkv.SegmentIntegrityError):
            prefixes.restore(prompt)


def test_saving_stores_only_new_blocks(tenants: TenantKV) -> None:
    model = _qwen2()
    prefixes = PrefixCache(tenants, "acme", model)
    prompt = _prompt(200, seed=10)
    output = _generate(model, prompt)
    assert prefixes.save(output.sequences, output.cache) == 192
    assert prefixes.save(output.sequences, output.cache) == 0
    longer = _generate(model, output.sequences, new=80)
    passed: list[tuple[int, int]] = []
    store = prefixes.namespace.store

    def spy(tokens: Any, layers: Any, **kwargs: Any) -> int:
        passed.append((kwargs["start"], layers[0][0].shape[0]))
        return store(tokens, layers, **kwargs)

    prefixes.namespace.store = spy  # type: ignore[method-assign]
    assert prefixes.save(longer.sequences, longer.cache) == 64  # 200 + 12 + 80 - 1 = 291
    # only the 64 rows after the cached 192 tokens were copied out of the model's cache
    assert passed == [(192, 64)]
    assert prefixes.save(prompt[:, :63], _generate(model, prompt[:, :63], new=1).cache) == 0


def test_bad_input_is_refused_and_changes_nothing(tenants: TenantKV) -> None:
    model = _llama()
    prefixes = PrefixCache(tenants, "acme", model)
    prompt = _prompt(140, seed=11)
    output = _generate(model, prompt)
    batch = _generate(model, torch.cat([prompt, prompt]), new=1)
    with pytest.raises(InvalidRequestError, match="batch size 1"):
        prefixes.save(torch.cat([prompt, prompt]), output.cache)
    with pytest.raises(InvalidRequestError, match="batch size 1"):
        prefixes.save(prompt, batch.cache)
    with pytest.raises(InvalidRequestError, match="Cache"):
        prefixes.save(prompt, [(torch.zeros(1), torch.zeros(1))])
    other_model_cache = _generate(_deepseek(), prompt, new=1).cache
    with pytest.raises(InvalidRequestError, match="layers"):
        prefixes.save(prompt, other_model_cache)
    wider = _generate(_llama(num_key_value_heads=4), prompt, new=1).cache
    with pytest.raises(InvalidRequestError, match="shape"):
        prefixes.save(prompt, wider)
    with pytest.raises(InvalidRequestError, match="tokens"):
        prefixes.save([0.5] * 140, output.cache)
    with pytest.raises(InvalidRequestError):
        prefixes.restore(torch.cat([prompt, prompt]))
    with pytest.raises(InvalidRequestError, match="PreTrainedModel"):
        PrefixCache(tenants, "acme", object())  # type: ignore[arg-type]
    with pytest.raises(tenantkv.TenantNotFoundError):
        PrefixCache(tenants, "nobody", model)
    assert prefixes.lookup(output.sequences) == 0  # nothing was stored by the refused calls


def test_models_whose_cache_cannot_be_cut_are_refused(tenants: TenantKV) -> None:
    torch.manual_seed(0)
    mistral = transformers.MistralForCausalLM(
        transformers.MistralConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=128,
        )
    )
    with pytest.raises(InvalidRequestError, match="sliding_attention"):
        PrefixCache(tenants, "acme", mistral)
    deepseek_v2 = transformers.DeepseekV2ForCausalLM(
        transformers.DeepseekV2Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
        )
    )
    with pytest.raises(InvalidRequestError, match="latent attention"):
        PrefixCache(tenants, "acme", deepseek_v2)


# ---- streaming restore: layers arrive while the model runs -------------------------------------


def test_streamed_restore_generates_the_same_as_full_prefill(tenants: TenantKV, model: Any) -> None:
    prefixes = PrefixCache(tenants, "acme", model)
    first = _prompt(260, seed=12)
    output = _generate(model, first)
    assert prefixes.save(output.sequences, output.cache) == 256
    follow_up = torch.cat([output.sequences, _prompt(60, seed=13)], dim=1)

    restored = prefixes.restore(follow_up, streaming=True)
    assert restored.num_tokens == 256 and restored.cache is not None
    layers = restored.cache.layers
    feed = layers[0]._feed
    assert feed is not None
    # Nothing handed over yet: the model starts with positions and masks only.
    assert feed.stream.delivered_layers == 0
    assert restored.cache.get_seq_length() == 256
    assert tenants.leased_extents()  # a running load's extent cannot be evicted

    after_restore = _generate(model, follow_up, cache=restored.cache, new=16)
    assert torch.equal(after_restore.sequences, _generate(model, follow_up, new=16).sequences)
    assert feed.stream.closed and feed.stream.delivered_layers == len(layers)
    assert not tenants.leased_extents()
    # The streamed cache is an ordinary cache afterwards: saving it stores the new full block
    # (272 + 60 + 16 - 1 = 347 cached tokens: blocks 0-4, of which 0-3 were restored).
    assert prefixes.save(after_restore.sequences, after_restore.cache) == 64


def test_a_streamed_restore_that_is_never_used_releases_its_load(tenants: TenantKV) -> None:
    import gc

    model = _llama()
    prefixes = PrefixCache(tenants, "acme", model)
    prompt = _prompt(200, seed=14)
    output = _generate(model, prompt)
    prefixes.save(output.sequences, output.cache)
    restored = prefixes.restore(prompt, streaming=True)
    assert restored.num_tokens == 192 and restored.cache is not None
    stream = restored.cache.layers[0]._feed.stream
    assert tenants.leased_extents()
    del restored
    gc.collect()
    assert stream.closed
    assert not tenants.leased_extents()


def test_a_streamed_restore_that_fails_mid_way_raises_and_drops_the_prefix(
    tenants: TenantKV, cache_root: Path
) -> None:
    model = _deepseek()
    prefixes = PrefixCache(tenants, "acme", model)
    prompt = _prompt(200, seed=15)
    output = _generate(model, prompt)
    prefixes.save(output.sequences, output.cache)
    (extent,) = [p for p in (cache_root / "blocks").rglob("*") if p.is_file()]
    data = bytearray(extent.read_bytes())
    data[-1] ^= 0x01  # the last layer's last segment: layer 0 still opens
    extent.write_bytes(bytes(data))

    restored = prefixes.restore(prompt, streaming=True)
    assert restored.num_tokens == 192  # the start of the load succeeded
    with pytest.raises(tenantkv.LoadError) as failure:
        _generate(model, prompt, cache=restored.cache)
    assert isinstance(failure.value, tenantkv.SegmentIntegrityError)
    assert failure.value.delivered_layers < model.config.num_hidden_layers
    assert prefixes.lookup(prompt) == 0  # evicted before the error was raised
    assert tenants.security_events().get("segment_open_failed", 0) == 1
    assert not tenants.leased_extents()
    # the caller's retry without the cache is a plain full prefill
    retry = prefixes.restore(prompt, streaming=True)
    assert retry.cache is None
    assert _generate(model, prompt, cache=retry.cache).sequences.shape[1] == 212


def test_streamed_layers_arrive_in_order_and_later_layers_repeat_a_failure(
    tenants: TenantKV,
) -> None:
    model = _llama(num_hidden_layers=3)
    prefixes = PrefixCache(tenants, "acme", model)
    prompt = _prompt(200, seed=16)
    output = _generate(model, prompt)
    prefixes.save(output.sequences, output.cache)

    restored = prefixes.restore(prompt, streaming=True)
    assert restored.cache is not None
    with pytest.raises(InvalidRequestError, match="in order"):
        _ = restored.cache.layers[1].keys  # layer 1 before layer 0
    keys = restored.cache.layers[0].keys  # a reader of keys receives the restored tokens
    assert keys is not None and keys.shape[-2] == 192
    assert restored.cache.layers[0]._feed is None  # an arrived layer lets go of the load
    feed = restored.cache.layers[1]._feed
    assert feed is not None
    feed.close()  # the load ends before layers 1 and 2 arrive
    with pytest.raises(tenantkv.CacheClosedError):
        _ = restored.cache.layers[1].keys
    with pytest.raises(tenantkv.CacheClosedError):  # the same error, not an ordering complaint
        _ = restored.cache.layers[2].keys
    assert not tenants.leased_extents()


@pytest.mark.parametrize(("codec", "make"), [("int4", _deepseek), ("fp8", _llama)])
def test_a_coded_prefix_cache_restores_close_to_the_saved_cache(
    tenants: TenantKV, codec: str, make: Any
) -> None:
    """Under a lossy codec a restore gives the model's dtype, close to (never claimed equal to)
    the saved cache, and generation runs on it; a namespace without the codec misses. (One
    model per codec keeps the suite short; tests/test_codecs.py covers both codecs on both
    layout kinds.)"""
    for model in (make(),):
        prefixes = PrefixCache(tenants, "acme", model, codec=codec)
        assert prefixes.layout.codec == codec
        first = _prompt(200, seed=1)
        output = _generate(model, first)
        assert prefixes.save(output.sequences, output.cache) == 192
        restored = prefixes.restore(output.sequences)
        assert restored.num_tokens == 192 and restored.cache is not None
        bound = 0.05 if codec == "fp8" else 0.2
        for saved, got in zip(output.cache.layers, restored.cache.layers, strict=True):
            for want, have in ((saved.keys, got.keys), (saved.values, got.values)):
                want = want[..., :192, :]
                assert have.dtype == want.dtype and have.shape == want.shape
                error = float((have.float() - want.float()).norm() / want.float().norm())
                assert 0 < error < bound
        assert _generate(model, output.sequences, cache=restored.cache).sequences.shape[1] > 0
        # The same model without the codec is another namespace (positive control: above).
        assert PrefixCache(tenants, "acme", model).lookup(output.sequences) == 0
