"""Editing restored caches of real (tiny, random) transformers models: DeepSeek-V3 (MLA latent
cache, only ``k_rot`` moves) and Llama (GQA, only K moves).

Generation from an edited cache restored from tenantkv must equal, token for token, generation
from the same edit applied to the in-memory cache; later turns save the edited conversation
and restore it by its origin, again equal to the in-memory path.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tenantkv import InvalidRequestError, TenantKV  # noqa: E402
from tenantkv.editing import EditScript, RopeSpec  # noqa: E402
from tenantkv.integrations.transformers import PrefixCache, rope_for  # noqa: E402
from tests.test_transformers_integration import (  # noqa: E402
    _deepseek,
    _generate,
    _llama,
    _prompt,
)

MODELS = {"deepseek_v3": _deepseek, "llama": _llama}
# Spans of the 312-token history: two inside the 256 restored tokens, one after them.
SCRIPT = EditScript.dropping([(30, 90), (140, 150), (280, 290)])


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> Any:
    return MODELS[request.param]()


@pytest.fixture
def tenants(kv: TenantKV) -> TenantKV:
    kv.create_tenant("acme")
    kv.create_tenant("globex")
    return kv


def _cropped(cache: Any, length: int) -> Any:
    copied = copy.deepcopy(cache)
    copied.crop(length - copied.get_seq_length())
    return copied


def _layers_equal(a: Any, b: Any) -> bool:
    return all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
        for x, y in zip(a.layers, b.layers, strict=True)
    )


def test_generation_from_an_edited_restored_cache_equals_the_in_memory_edit(
    tenants: TenantKV, model: Any
) -> None:
    prefixes = PrefixCache(tenants, "acme", model)
    first = _generate(model, _prompt(260, seed=1))  # 271 cached tokens
    assert prefixes.save(first.sequences, first.cache) == 256
    history = torch.cat([first.sequences, _prompt(40, seed=2)], dim=1)  # 312 tokens

    # tenantkv: restore the cached prefix, edit it, generate.
    restored = prefixes.restore(history)
    assert restored.num_tokens == 256
    edited = prefixes.edit(restored, history, SCRIPT)
    assert edited.num_tokens == 256 - 70 and edited.cache is not None
    assert edited.cache.get_seq_length() == 186
    assert edited.tokens.shape == (1, 312 - 80)
    assert edited.origin is not None and edited.origin.dropped_tokens == 70
    # In memory: the turn-1 cache cut to the same 256 tokens, the same edit, the same input.
    in_memory = prefixes.edit_cache(_cropped(first.cache, 256), SCRIPT)
    assert _layers_equal(in_memory, edited.cache)
    edited_layers = [(layer.keys.clone(), layer.values.clone()) for layer in edited.cache.layers]
    second = _generate(model, edited.tokens, cache=edited.cache, new=16)
    reference = _generate(model, SCRIPT.apply_to_tokens(history[0])[None], cache=in_memory, new=16)
    assert torch.equal(second.sequences, reference.sequences)

    # Only keys moved: the values (MLA: k_rot is the cache's "values"; MHA: V) tell which part.
    kept = SCRIPT.kept_positions(256)
    for original, (keys, values) in zip(first.cache.layers, edited_layers, strict=True):
        if model.config.model_type == "deepseek_v3":  # keys = c_KV (untouched), values = k_rot
            assert torch.equal(keys, original.keys[..., kept, :])
            assert not torch.equal(values[..., 30:, :], original.values[..., kept[30:], :])
        else:  # keys = K (moved), values = V (untouched)
            assert torch.equal(values, original.values[..., kept, :])
            assert not torch.equal(keys[..., 30:, :], original.keys[..., kept[30:], :])

    # A later turn: save the edited conversation on its chain, restore it by its origin.
    assert prefixes.save(second.sequences, second.cache, origin=edited.origin) == 192
    assert prefixes.lookup(second.sequences, origin=edited.origin) == 192
    assert prefixes.lookup(second.sequences) == 0  # not an unedited prefix
    third_input = torch.cat([second.sequences, _prompt(30, seed=3)], dim=1)
    again = prefixes.restore(third_input, origin=edited.origin)
    assert again.num_tokens == 192 and again.origin == edited.origin
    third = _generate(model, third_input, cache=again.cache, new=16)
    third_reference = _generate(
        model,
        torch.cat([reference.sequences, _prompt(30, seed=3)], dim=1),
        cache=_cropped(reference.cache, 192),
        new=16,
    )
    assert torch.equal(third.sequences, third_reference.sequences)


def test_edited_restores_are_isolated_with_the_owner_hit_as_control(tenants: TenantKV) -> None:
    model = _llama()
    owner = PrefixCache(tenants, "acme", model, scope="agent")
    first = _generate(model, _prompt(200, seed=4))
    owner.save(first.sequences, first.cache)
    history = torch.cat([first.sequences, _prompt(20, seed=5)], dim=1)
    script = EditScript.dropping([(10, 40)])
    edited = owner.edit(owner.restore(history), history, script)
    turn = _generate(model, edited.tokens, cache=edited.cache, new=4)
    assert owner.save(turn.sequences, turn.cache, origin=edited.origin) == 192
    assert owner.lookup(turn.sequences, origin=edited.origin) == 192  # control

    for other in (
        PrefixCache(tenants, "globex", model, scope="agent"),
        PrefixCache(tenants, "acme", model, scope="other"),
    ):
        other.save(first.sequences, first.cache)
        theirs = other.edit(other.restore(history), history, script)
        assert other.lookup(turn.sequences, origin=theirs.origin) == 0
        with pytest.raises(InvalidRequestError, match="another namespace"):
            other.restore(turn.sequences, origin=edited.origin)


def test_rope_comes_from_the_model_config_with_scaling() -> None:
    yarn = _deepseek(
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "rope_theta": 10000.0,
        }
    )
    spec = rope_for(yarn)
    assert spec.pairs == "half" and spec.rotary_dims == 16
    assert spec.inv_freq == tuple(yarn.model.rotary_emb.inv_freq.tolist())
    assert spec != RopeSpec.standard(10000.0, 16)  # the scaling is in the frequencies
    llama3 = _llama(
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        }
    )
    assert rope_for(llama3).inv_freq == tuple(llama3.model.rotary_emb.inv_freq.tolist())
    assert rope_for(_llama()) == RopeSpec.standard(10000.0, 16)
    dynamic = _llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(InvalidRequestError, match="dynamic"):
        rope_for(dynamic)


def test_editing_a_cache_the_model_already_extended_is_refused(tenants: TenantKV) -> None:
    model = _llama()
    prefixes = PrefixCache(tenants, "acme", model)
    first = _generate(model, _prompt(140, seed=6))
    prefixes.save(first.sequences, first.cache)
    restored = prefixes.restore(first.sequences)
    assert restored.num_tokens == 128  # control: the prefix is there
    _generate(model, first.sequences, cache=restored.cache, new=1)
    with pytest.raises(InvalidRequestError, match="edit it before"):
        prefixes.edit(restored, first.sequences, EditScript.dropping([(0, 10)]))
    with pytest.raises(InvalidRequestError, match="EditScript"):
        prefixes.edit(prefixes.restore(first.sequences), first.sequences, [(0, 10)])  # type: ignore[arg-type]
