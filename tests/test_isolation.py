"""Namespaces are isolated: tenant, scope and model fingerprint each separate caches.

Every test first shows the owner's hit (positive control), so a broken store cannot make an
isolation test pass.
"""

from __future__ import annotations

import pytest
import torch

from tenantkv import KVLayout, TenantKV
from tenantkv.index.schema import Block
from tests.helpers import MLA_SMALL, layers_equal, load_all, random_layers, random_tokens

TOKENS = random_tokens(256, seed=11)


@pytest.fixture
def owner(kv: TenantKV) -> TenantKV:
    kv.create_tenant("acme")
    kv.create_tenant("globex")
    ns = kv.namespace("acme", model="deepseek-v3", layout=MLA_SMALL, scope="alice")
    assert ns.store(TOKENS, random_layers(MLA_SMALL, len(TOKENS))) == 256
    return kv


def test_owner_hits(owner: TenantKV) -> None:
    ns = owner.namespace("acme", model="deepseek-v3", layout=MLA_SMALL, scope="alice")
    assert ns.lookup(TOKENS) == 256
    assert len(load_all(ns, TOKENS)) == MLA_SMALL.num_layers


def test_other_tenant_misses(owner: TenantKV) -> None:
    other = owner.namespace("globex", model="deepseek-v3", layout=MLA_SMALL, scope="alice")
    assert other.lookup(TOKENS) == 0


@pytest.mark.parametrize("scope", [None, "bob", "Alice", "alice "])
def test_other_scope_misses(owner: TenantKV, scope: str | None) -> None:
    other = owner.namespace("acme", model="deepseek-v3", layout=MLA_SMALL, scope=scope)
    assert other.lookup(TOKENS) == 0


@pytest.mark.parametrize(
    ("model", "layout", "revision"),
    [
        ("deepseek-v3.1", MLA_SMALL, None),
        ("deepseek-v3", MLA_SMALL, "r2"),
        ("deepseek-v3", KVLayout.mla(3, kv_lora_rank=32, rope_dim=8, dtype=torch.float16), None),
        ("deepseek-v3", KVLayout.mla(4, kv_lora_rank=32, rope_dim=8, dtype=torch.bfloat16), None),
        ("deepseek-v3", KVLayout.mla(3, kv_lora_rank=24, rope_dim=16, dtype=torch.bfloat16), None),
    ],
    ids=["model-id", "revision", "dtype", "num-layers", "split"],
)
def test_other_model_fingerprint_misses(
    owner: TenantKV, model: str, layout: KVLayout, revision: str | None
) -> None:
    other = owner.namespace("acme", model=model, layout=layout, scope="alice", revision=revision)
    assert other.lookup(TOKENS) == 0


def test_other_namespace_storing_the_same_tokens_gets_its_own_data(owner: TenantKV) -> None:
    mine = owner.namespace("acme", model="deepseek-v3", layout=MLA_SMALL, scope="alice")
    theirs = owner.namespace("globex", model="deepseek-v3", layout=MLA_SMALL, scope="alice")
    their_layers = random_layers(MLA_SMALL, len(TOKENS), seed=99)
    assert theirs.store(TOKENS, their_layers) == 256  # nothing is shared or deduplicated
    for got, want in zip(load_all(theirs, TOKENS), their_layers, strict=True):
        assert layers_equal(got, want)
    for got, want in zip(load_all(mine, TOKENS), their_layers, strict=True):
        assert not layers_equal(got, want)


def test_identical_tokens_give_unrelated_keys_in_different_namespaces(owner: TenantKV) -> None:
    namespaces = [
        owner.namespace("acme", model="deepseek-v3", layout=MLA_SMALL, scope="alice"),
        owner.namespace("acme", model="deepseek-v3", layout=MLA_SMALL, scope="bob"),
        owner.namespace("globex", model="deepseek-v3", layout=MLA_SMALL, scope="alice"),
        owner.namespace("acme", model="other", layout=MLA_SMALL, scope="alice"),
    ]
    key_sets = [ns._keys(TOKENS) for ns in namespaces]
    # Same namespace, same tokens: same keys (the positive control for determinism).
    assert namespaces[0]._keys(TOKENS) == key_sets[0]
    all_keys = [key for keys in key_sets for key in keys]
    assert len(set(all_keys)) == len(all_keys), "a block key repeats across namespaces"
    # Unrelated, not merely different: about half the bits differ between namespaces.
    for keys in key_sets[1:]:
        for a, b in zip(key_sets[0], keys, strict=True):
            differing = bin(int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).count("1")
            assert 64 < differing < 192


def test_index_rows_are_per_namespace(owner: TenantKV) -> None:
    theirs = owner.namespace("globex", model="deepseek-v3", layout=MLA_SMALL, scope="alice")
    theirs.store(TOKENS, random_layers(MLA_SMALL, len(TOKENS), seed=5))
    with owner.context.index.read() as session:
        rows = session.query(Block.namespace_id, Block.block_key).all()
    assert len({ns for ns, _ in rows}) == 2
    assert len({key for _, key in rows}) == len(rows) == 8
