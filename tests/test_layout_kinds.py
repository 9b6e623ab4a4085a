"""Layout kinds are strategies found by name: a new kind plugs in without touching the store,
the loader or the namespace."""

from __future__ import annotations

import pytest
import torch

import tenantkv
from tenantkv.layout_kinds import LatentKind, layout_kind, register_layout_kind

from .helpers import layers_equal, load_all, random_tokens


class _RenamedLatent(LatentKind):
    """The latent layout under another name: a stand-in for a new model family's kind."""

    name = "latent-test"


register_layout_kind(_RenamedLatent())


def test_a_registered_kind_stores_and_loads_and_is_its_own_namespace(kv: tenantkv.TenantKV) -> None:
    kv.create_tenant("acme")
    custom = tenantkv.KVLayout("latent-test", 2, torch.bfloat16, kv_lora_rank=16, rope_dim=8)
    builtin = tenantkv.KVLayout.mla(2, kv_lora_rank=16, rope_dim=8, dtype=torch.bfloat16)
    assert custom.token_bytes == builtin.token_bytes
    tokens = random_tokens(128)
    layers = [torch.randn(128, 24).to(torch.bfloat16) for _ in range(2)]
    ns = kv.namespace("acme", model="m", layout=custom)
    assert ns.store(tokens, layers) == 128
    assert all(layers_equal(a, b) for a, b in zip(load_all(ns, tokens), layers, strict=True))
    # the kind is part of the fingerprint: the built-in kind of the same shape misses
    assert kv.namespace("acme", model="m", layout=builtin).lookup(tokens) == 0


def test_unknown_and_duplicate_kinds_are_refused() -> None:
    with pytest.raises(tenantkv.InvalidRequestError, match="unknown layout kind 'nope'"):
        layout_kind("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_layout_kind(_RenamedLatent())
