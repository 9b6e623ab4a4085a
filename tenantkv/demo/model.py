"""The demo's model: a small DeepSeek-V3-style transformers model, randomly initialised.

It has the real architecture -- multi-head latent attention whose cache is the latent ``c_KV``
and the rotated ``k_rot``, mixture-of-experts layers after the first dense one -- at a size
that prefills a few thousand tokens in about a second on two CPU cores. The weights are drawn
from a fixed seed, so every run (and every tenant) serves the same model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache, PreTrainedModel

from .conversation import VOCAB_SIZE

LayerProgress = Callable[[int, int], None]
"""Called with (layers done, layers in all) as a forward pass goes through the decoder."""


@dataclass(frozen=True)
class ModelSize:
    num_layers: int
    hidden_size: int
    kv_lora_rank: int
    rope_dim: int


FULL = ModelSize(num_layers=6, hidden_size=256, kv_lora_rank=128, rope_dim=32)
FAST = ModelSize(num_layers=3, hidden_size=96, kv_lora_rank=48, rope_dim=16)


def build_model(size: ModelSize, seed: int = 0) -> DeepseekV3ForCausalLM:
    """A DeepSeek-V3-style model with weights drawn from ``seed`` (no download)."""
    config = DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=size.hidden_size,
        intermediate_size=2 * size.hidden_size,
        moe_intermediate_size=size.hidden_size // 2,
        num_hidden_layers=size.num_layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        kv_lora_rank=size.kv_lora_rank,
        q_lora_rank=size.kv_lora_rank + size.kv_lora_rank // 2,
        qk_rope_head_dim=size.rope_dim,
        qk_nope_head_dim=size.rope_dim,
        v_head_dim=size.rope_dim,
        max_position_embeddings=16_384,
        # Larger than the default 0.02 so that greedy decoding of the random model does not
        # collapse onto one repeated token, which would make "same output" a weak check.
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config)
    torch.nn.Module.eval(model)
    return model


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    ttft_s: float  # from starting the forward pass to having the first new token
    cache: DynamicCache


def greedy(
    model: PreTrainedModel,
    prompt: list[int],
    cache: DynamicCache | None,
    max_new_tokens: int,
    progress: LayerProgress | None = None,
) -> Generation:
    """Greedy decoding of ``prompt``, computing only what ``cache`` does not hold.

    The first forward pass runs the prompt's uncached tokens; its last logits give the first
    token (time to first token). ``progress`` is told about each decoder layer of that pass.
    """
    cache = cache if cache is not None else DynamicCache(config=model.config)
    cached = cache.get_seq_length()
    hooks = []
    if progress is not None:
        layers = list(model.model.layers)
        total = len(layers)
        for index, layer in enumerate(layers):
            hooks.append(
                layer.register_forward_hook(lambda *_, done=index + 1: progress(done, total))
            )
    ids = torch.tensor([prompt[cached:]], dtype=torch.long)
    new_tokens: list[int] = []
    with torch.no_grad():
        started = time.perf_counter()
        try:
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits
        finally:
            for hook in hooks:
                hook.remove()
        new_tokens.append(int(logits[0, -1].argmax()))
        ttft = time.perf_counter() - started
        while len(new_tokens) < max_new_tokens:
            step = torch.tensor([[new_tokens[-1]]], dtype=torch.long)
            logits = model(input_ids=step, cache=cache, use_cache=True).logits
            new_tokens.append(int(logits[0, -1].argmax()))
    return Generation(new_tokens, ttft, cache)
