"""The block size is carried by the namespace: keys, lookups, stores and loads come in whole
blocks of it, and it is part of the namespace's identity."""

from __future__ import annotations

import pytest
import torch

import tenantkv

from .helpers import (
    MHA_SMALL,
    MLA_SMALL,
    layers_equal,
    load_all,
    random_layers,
    random_tokens,
)


@pytest.mark.parametrize("block_tokens", [16, 32, 48, 128])
@pytest.mark.parametrize("layout", [MLA_SMALL, MHA_SMALL], ids=["mla", "mha"])
def test_stores_lookups_and_loads_come_in_the_namespaces_blocks(
    kv: tenantkv.TenantKV, block_tokens: int, layout: tenantkv.KVLayout
) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=layout, block_tokens=block_tokens)
    assert ns.block_tokens == block_tokens
    tokens = random_tokens(5 * block_tokens + 7)
    layers = random_layers(layout, len(tokens))
    assert ns.store(tokens, layers) == 5 * block_tokens  # the partial tail is not stored
    assert ns.lookup(tokens) == 5 * block_tokens
    diverging = [*tokens[: 2 * block_tokens + 3], *random_tokens(4 * block_tokens, seed=9)]
    assert ns.lookup(diverging) == 2 * block_tokens
    cached = tokens[: 3 * block_tokens]
    got = load_all(ns, cached)
    want = [
        layer[: len(cached)]
        if isinstance(layer, torch.Tensor)
        else tuple(x[: len(cached)] for x in layer)
        for layer in layers
    ]
    assert all(layers_equal(a, b) for a, b in zip(got, want, strict=True))  # type: ignore[arg-type]
    with pytest.raises(tenantkv.InvalidRequestError, match=f"{block_tokens}-token blocks"):
        ns.load(tokens[: block_tokens + 1])


def test_paged_out_buffers_take_the_namespaces_block_size(kv: tenantkv.TenantKV) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL, block_tokens=32)
    tokens = random_tokens(64)
    layers = random_layers(MLA_SMALL, 64)
    ns.store(tokens, layers)
    out = [torch.zeros(128, MLA_SMALL.values_per_token, dtype=MLA_SMALL.dtype) for _ in layers]
    with ns.load(tokens, out=out, block_rows=[96, 0]) as stream:
        for index, buffer in stream:
            assert torch.equal(buffer[96:128], layers[index][:32])  # type: ignore[index]
            assert torch.equal(buffer[0:32], layers[index][32:64])  # type: ignore[index]
            assert not buffer[32:96].any()
    with pytest.raises(tenantkv.InvalidRequestError, match="32 consecutive rows"):
        ns.load(tokens, out=out, block_rows=[0, 16])


def test_the_block_size_is_part_of_the_namespace(kv: tenantkv.TenantKV) -> None:
    kv.create_tenant("acme")
    tokens = random_tokens(128)
    default = kv.namespace("acme", model="m", layout=MLA_SMALL)
    assert default.block_tokens == 64
    default.store(tokens, random_layers(MLA_SMALL, 128))
    assert default.lookup(tokens) == 128  # positive control
    assert kv.namespace("acme", model="m", layout=MLA_SMALL, block_tokens=32).lookup(tokens) == 0
    # an explicit 64 is the default namespace, so caches made before sizes existed still hit
    assert kv.namespace("acme", model="m", layout=MLA_SMALL, block_tokens=64).lookup(tokens) == 128


@pytest.mark.parametrize("bad", [0, 8, 24, 2048, -64, 64.0, True, "64"])
def test_bad_block_sizes_are_refused(kv: tenantkv.TenantKV, bad: object) -> None:
    kv.create_tenant("acme")
    with pytest.raises(tenantkv.InvalidRequestError, match="block_tokens"):
        kv.namespace("acme", model="m", layout=MLA_SMALL, block_tokens=bad)  # type: ignore[arg-type]
