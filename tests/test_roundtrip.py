"""Store -> lookup -> load is exact to the byte, for every layout and dtype."""

from __future__ import annotations

import pytest
import torch

import tenantkv
from tenantkv import KVLayout, TenantKV
from tests.helpers import layers_equal, load_all, prefix_of, random_layers, random_tokens

LAYOUTS = [
    pytest.param(KVLayout.mla(3, kv_lora_rank=32, rope_dim=8, dtype=dtype), id=f"mla-{name}")
    for dtype, name in [(torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")]
] + [
    pytest.param(KVLayout.mha(2, num_kv_heads=2, head_dim=8, dtype=dtype), id=f"mha-{name}")
    for dtype, name in [(torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")]
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_exact_round_trip(kv: TenantKV, layout: KVLayout) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=layout)
    tokens = random_tokens(300)  # 4 full blocks and a partial one
    layers = random_layers(layout, 300)

    assert ns.store(tokens, layers) == 256
    assert ns.lookup(tokens) == 256
    loaded = load_all(ns, tokens[:256])
    assert len(loaded) == layout.num_layers
    for got, want in zip(loaded, layers, strict=True):
        assert layers_equal(got, prefix_of(want, 256))


def test_mla_layer_is_one_tensor_and_mha_layer_a_pair(kv: TenantKV) -> None:
    kv.create_tenant("acme")
    mla = KVLayout.mla(1, kv_lora_rank=16, rope_dim=4, dtype=torch.bfloat16)
    mha = KVLayout.mha(1, num_kv_heads=3, head_dim=4, dtype=torch.float32)
    for layout in (mla, mha):
        ns = kv.namespace("acme", model="m", layout=layout)
        tokens = random_tokens(64)
        ns.store(tokens, random_layers(layout, 64))
        (layer,) = load_all(ns, tokens)
        if layout.kind == "mla":
            assert isinstance(layer, torch.Tensor)
            assert layer.shape == (64, 20) and layer.dtype == torch.bfloat16
        else:
            assert isinstance(layer, tuple)
            k, v = layer
            assert k.shape == v.shape == (64, 3, 4) and k.dtype == torch.float32


def test_partial_hit_when_prompt_diverges_inside_a_block(kv: TenantKV) -> None:
    layout = KVLayout.mla(2, kv_lora_rank=16, rope_dim=4, dtype=torch.bfloat16)
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=layout)
    tokens = random_tokens(6 * 64, seed=1)
    layers = random_layers(layout, len(tokens))
    ns.store(tokens, layers)

    for k in range(6):
        for inside in (0, 1, 63):
            diverged = list(tokens)
            at = 64 * k + inside
            diverged[at] = (diverged[at] + 1) % 50_000
            assert ns.lookup(diverged) == 64 * k, f"diverging at token {at}"
    assert ns.lookup([*tokens, 5, 6, 7]) == 6 * 64
    # The hit loads exactly.
    diverged = tokens[: 64 * 3 + 10] + [1] * 100
    hit = ns.lookup(diverged)
    assert hit == 192
    for got, want in zip(load_all(ns, diverged[:hit]), layers, strict=True):
        assert layers_equal(got, prefix_of(want, hit))


def test_extending_a_cached_prefix_stores_only_new_blocks(kv: TenantKV) -> None:
    layout = KVLayout.mha(2, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16)
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=layout)
    tokens = random_tokens(8 * 64, seed=2)
    layers = random_layers(layout, len(tokens))

    first = [prefix_of(layer, 3 * 64) for layer in layers]
    assert ns.store(tokens[: 3 * 64], first) == 3 * 64
    blocks_before = kv.info()["blocks"]
    assert ns.store(tokens, layers) == 5 * 64
    info = kv.info()
    assert info["blocks"] == blocks_before + 5
    assert info["extents"] == 2
    assert sorted(ns.cached_blocks()) == list(range(8))
    # Storing the same prefix again writes nothing.
    assert ns.store(tokens, layers) == 0
    assert kv.info()["extents"] == 2
    # The prefix spans two extents and still loads exactly.
    for got, want in zip(load_all(ns, tokens), layers, strict=True):
        assert layers_equal(got, want)


def test_tokens_as_tensor_list_and_array_are_the_same_prefix(kv: TenantKV) -> None:
    import numpy as np

    layout = KVLayout.mla(1, kv_lora_rank=8, rope_dim=8, dtype=torch.float16)
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=layout)
    tokens = random_tokens(128, seed=3)
    ns.store(torch.tensor(tokens, dtype=torch.int64), random_layers(layout, 128))
    assert ns.lookup(tokens) == 128
    assert ns.lookup(np.array(tokens, dtype=np.int32)) == 128
    assert ns.lookup(torch.tensor(tokens, dtype=torch.int32)) == 128


def test_wait_for_layer_out_of_order_and_then_iterate(kv: TenantKV) -> None:
    layout = KVLayout.mla(4, kv_lora_rank=8, rope_dim=8, dtype=torch.bfloat16)
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=layout)
    tokens = random_tokens(128)
    layers = random_layers(layout, 128)
    ns.store(tokens, layers)
    with ns.load(tokens) as stream:
        assert torch.equal(stream.wait_for_layer(2), layers[2])  # type: ignore[arg-type]
        seen = [(i, torch.equal(layer, layers[i])) for i, layer in stream]  # type: ignore[arg-type]
    assert seen == [(i, True) for i in range(4)]
    assert stream.closed


def test_leaving_the_stream_early_closes_it(kv: TenantKV) -> None:
    layout = KVLayout.mla(6, kv_lora_rank=8, rope_dim=8, dtype=torch.bfloat16)
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=layout)
    tokens = random_tokens(64)
    ns.store(tokens, random_layers(layout, 64))
    with ns.load(tokens) as stream:
        for index, _layer in stream:
            if index == 1:
                break
    assert stream.closed
    with pytest.raises(tenantkv.CacheClosedError):
        stream.wait_for_layer(3)
    # The cache keeps working after an abandoned stream.
    assert len(load_all(ns, tokens)) == 6


def test_ocb3_suite_round_trips_and_gcm_data_stays_readable(cache_root: object) -> None:
    from pathlib import Path

    root = Path(str(cache_root))
    layout = KVLayout.mla(2, kv_lora_rank=8, rope_dim=8, dtype=torch.bfloat16)
    gcm_tokens, ocb_tokens = random_tokens(128, seed=4), random_tokens(128, seed=5)
    gcm_layers, ocb_layers = random_layers(layout, 128, seed=4), random_layers(layout, 128, seed=5)
    with tenantkv.open(root, durable=False) as kv:
        kv.create_tenant("acme")
        kv.namespace("acme", model="m", layout=layout).store(gcm_tokens, gcm_layers)
    with tenantkv.open(root, durable=False, suite="aes-256-ocb3") as kv:
        ns = kv.namespace("acme", model="m", layout=layout)
        assert ns.store(ocb_tokens, ocb_layers) == 128
        for tokens, layers in ((gcm_tokens, gcm_layers), (ocb_tokens, ocb_layers)):
            for got, want in zip(load_all(ns, tokens), layers, strict=True):
                assert layers_equal(got, want)
