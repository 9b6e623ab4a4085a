"""RoPE repositioning: a key cached at position p and moved by delta equals the key computed
fresh at p + delta, for MLA ``k_pe`` and MHA K, both pair layouts, scaled frequencies; and an
edit changes nothing but the moved keys (``c_KV`` and V bytes stay identical).

The reference rotation is computed independently of :func:`rotate_to`: in float64 from the
pre-RoPE keys, with cos/sin laid out as transformers lays them (``cat(freqs, freqs)`` and
``rotate_half`` for half-split pairs; even/odd for interleaved pairs), then rounded to float32.
"""

from __future__ import annotations

import pytest
import torch

from tenantkv import InvalidRequestError, KVLayout
from tenantkv.editing import EditScript, RopeSpec, edit_layer, rotate_to

TOLERANCE = 1e-5


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_at(pre: torch.Tensor, positions: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Reference: ``pre`` ([T, ..., D], not yet rotated) rotated at ``positions``, in float64."""
    x = pre.to(torch.float64)
    dims = rope.rotary_dims
    freqs = positions.to(torch.float64)[:, None] * torch.tensor(rope.inv_freq, dtype=torch.float64)
    view = (len(positions),) + (1,) * (pre.dim() - 2) + (dims,)
    rotary = x[..., :dims]
    if rope.pairs == "half":
        emb = torch.cat((freqs, freqs), dim=-1).view(view)
        moved = rotary * emb.cos() + _rotate_half(rotary) * emb.sin()
    else:  # pairs (2i, 2i+1): rotate_half of the de-interleaved view, interleaved back
        emb = freqs.repeat_interleave(2, dim=-1).view(view)
        swapped = torch.stack((-rotary[..., 1::2], rotary[..., 0::2]), dim=-1).flatten(-2)
        moved = rotary * emb.cos() + swapped * emb.sin()
    return torch.cat((moved, x[..., dims:]), dim=-1)


def _llama3_frequencies(rotary_dims: int) -> RopeSpec:
    """Llama 3's scaled frequencies, as transformers computes them (factor 8, window 64)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=4 * rotary_dims,
        num_attention_heads=4,
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
    )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    return RopeSpec.from_frequencies(inv_freq)


SPECS = {
    "standard": lambda dims: RopeSpec.standard(10000.0, dims),
    "linear-x4": lambda dims: RopeSpec.from_frequencies(
        RopeSpec.standard(10000.0, dims).inv_freq[i] / 4 for i in range(dims // 2)
    ),
    "llama3": _llama3_frequencies,
}


@pytest.mark.parametrize("pairs", ["half", "interleaved"])
@pytest.mark.parametrize("frequencies", sorted(SPECS))
@pytest.mark.parametrize("shape", [(64,), (4, 32)], ids=["mla-k_pe", "mha-k"])
def test_moving_a_cached_key_equals_computing_it_at_the_new_position(
    pairs: str, frequencies: str, shape: tuple[int, ...]
) -> None:
    dims = shape[-1]
    base = SPECS[frequencies](dims)
    rope = RopeSpec(base.inv_freq, pairs)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(len(frequencies) + dims)
    tokens = 96
    pre = torch.randn((tokens, *shape), generator=generator, dtype=torch.float64) * 2
    old = torch.randint(0, 5000, (tokens,), generator=generator)
    delta = torch.randint(-3000, 3000, (tokens,), generator=generator)
    delta[:8] = 0  # some tokens do not move
    delta = torch.maximum(delta, -old)  # positions stay >= 0
    cached = rope_at(pre, old, rope).to(torch.float32)
    fresh = rope_at(pre, old + delta, rope).to(torch.float32)

    moved = rotate_to(cached, delta, rope)
    assert moved.dtype == torch.float32
    error = (moved - fresh).abs().max().item()
    assert error <= TOLERANCE, f"max abs error {error}"
    # the rows that do not move are the cached bytes themselves
    assert torch.equal(moved[:8], cached[:8])
    # control: the comparison tells positions apart (an unmoved key is far from the fresh one)
    assert (cached[8:] - fresh[8:]).abs().max().item() > 100 * TOLERANCE


def test_scaled_frequencies_differ_from_the_unscaled_ones() -> None:
    """The scaled specs above are not the plain one under another name."""
    plain = RopeSpec.standard(10000.0, 64).inv_freq
    assert _llama3_frequencies(64).inv_freq != plain
    assert SPECS["linear-x4"](64).inv_freq != plain


def test_only_the_rotary_dimensions_move() -> None:
    """Partial rotary (2 * len(inv_freq) < head_dim): the other dimensions are not touched."""
    rope = RopeSpec.standard(10000.0, 16)
    keys = torch.randn(10, 2, 32)
    moved = rotate_to(keys, torch.full((10,), -5), rope)
    assert torch.equal(moved[..., 16:], keys[..., 16:])
    assert not torch.equal(moved[..., :16], keys[..., :16])


def _bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().view(torch.uint8).flatten().tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drop_and_repos_of_an_mla_layer_leaves_c_kv_bytes_identical(dtype: torch.dtype) -> None:
    layout = KVLayout.mla(1, kv_lora_rank=32, rope_dim=16, dtype=dtype)
    rope = RopeSpec.standard(10000.0, 16, "interleaved")
    layer = torch.randn(200, 48).to(dtype)
    script = EditScript.dropping([(40, 70), (120, 130)])
    edited = edit_layer(layout, layer, 200, script, rope)
    assert isinstance(edited, torch.Tensor)
    kept = script.kept_positions(200)
    assert edited.shape == (160, 48) and len(kept) == 160
    assert _bytes(edited[:, :32]) == _bytes(layer[kept, :32])  # c_KV: identical bytes
    assert torch.equal(edited[:40], layer[:40])  # before the first drop nothing moves
    assert not torch.equal(edited[40:, 32:], layer[kept[40:], 32:])  # k_pe after it moved
    _, delta = script.shifts(200)
    expected = rotate_to(layer[kept, 32:], delta, rope)
    assert torch.equal(edited[:, 32:], expected)
    assert torch.equal(layer, layer.clone())  # the input is unchanged (a new layer is returned)


def test_drop_and_repos_of_an_mha_layer_leaves_v_bytes_identical() -> None:
    layout = KVLayout.mha(1, num_kv_heads=2, head_dim=16, dtype=torch.float16)
    rope = RopeSpec.standard(500000.0, 16)
    k = torch.randn(130, 2, 16).half()
    v = torch.randn(130, 2, 16).half()
    original_k = k.clone()
    script = EditScript.dropping([(0, 10), (64, 65)])
    edited = edit_layer(layout, (k, v), 130, script, rope)
    assert isinstance(edited, tuple)
    new_k, new_v = edited
    kept = script.kept_positions(130)
    assert _bytes(new_v) == _bytes(v[kept])  # V: identical bytes
    assert new_k.shape == (119, 2, 16)
    assert not torch.equal(new_k, k[kept])  # K moved
    assert torch.equal(k, original_k)


def test_edit_scripts_merge_spans_and_refuse_bad_ones() -> None:
    script = EditScript.dropping([(10, 20), (5, 12), (20, 25), (40, 41)])
    assert script.drops == ((5, 25), (40, 41))
    assert script.dropped_tokens() == 21
    assert script.within(22).drops == ((5, 22),)
    assert script.dropped_tokens(22) == 17
    kept, delta = script.shifts(45)
    assert kept[:5].tolist() == [0, 1, 2, 3, 4] and kept[5].item() == 25
    assert delta.tolist()[:6] == [0, 0, 0, 0, 0, -20] and delta[-1].item() == -21
    assert script.canonical_bytes() == EditScript.dropping([(40, 41), (5, 25)]).canonical_bytes()
    assert script.canonical_bytes() != EditScript.dropping([(5, 25)]).canonical_bytes()
    tokens = torch.arange(45)
    assert script.apply_to_tokens(tokens).tolist() == [*range(5), *range(25, 40), *range(41, 45)]
    for bad in ([(3, 3)], [(-1, 4)], [(1, 2, 3)], [("a", 2)], [(True, 2)]):
        with pytest.raises(InvalidRequestError):
            EditScript.dropping(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="sorted"):
        EditScript(((10, 20), (5, 8)))
    with pytest.raises(InvalidRequestError, match="rotates"):
        rotate_to(torch.zeros(3, 8), torch.zeros(3, dtype=torch.int64), RopeSpec.standard(1e4, 16))
