"""Copies between an engine's paged KV cache and tenantkv's per-layer rows (pure torch).

vLLM (and SGLang's host pool) keep each layer's KV in pages of ``block_size`` tokens. vLLM's
per-layer view is ``[num_blocks, H, N, C]`` (blocks first, then head slots, tokens of the
block, and a cell): for MHA/GQA ``H`` is the KV heads and a cell is the head's key followed by
its value (``C = 2 * head_dim``); for MLA ``H`` is 1 and a cell is one latent row
(``kv_lora_rank + rope_dim``). tenantkv keeps a layer as ``(k, v)`` of ``[T, H, D]`` (MHA) or
``[T, kv_lora_rank + rope_dim]`` (MLA). A request's token ``t`` lives in block
``block_ids[t // N]`` at offset ``t % N`` (the slot mapping at block granularity), so gathering
and scattering go a whole block at a time.

Engine-free on purpose: the engine tests and the main suite use the same copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InvalidRequestError
from ..layout import KVLayout, Layer


def typed_view(kv_layer: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """``kv_layer`` as a ``[B, H, N, C]`` view of the layout's dtype: engines may hand a byte
    view of the same memory, and MLA pages without the head axis (vLLM's CPU MLA backend:
    ``[B, N, C]``)."""
    if layout.kind == "mla" and kv_layer.dim() == 3:
        kv_layer = kv_layer.unsqueeze(1)
    if kv_layer.dtype == layout.dtype:
        return kv_layer
    if kv_layer.dtype in (torch.uint8, torch.int8):
        return kv_layer.view(layout.dtype)
    raise InvalidRequestError(
        f"the engine's KV cache is {kv_layer.dtype}, the namespace's layout {layout.dtype}"
    )


def check_page_shape(kv_layer: torch.Tensor, layout: KVLayout, block_tokens: int) -> None:
    """Refuse a page shape that does not match the layout (a wrong copy would be wrong data)."""
    if kv_layer.dim() != 4:
        raise InvalidRequestError(f"expected a [B, H, N, C] page view, got {tuple(kv_layer.shape)}")
    _, heads, tokens, cell = kv_layer.shape
    if layout.kind == "mla":
        expected = (1, block_tokens, layout.values_per_token)
    else:
        expected = (layout.num_kv_heads, block_tokens, 2 * layout.head_dim)
    if (heads, tokens, cell) != expected:
        raise InvalidRequestError(
            f"page view {tuple(kv_layer.shape)} does not match the layout: expected "
            f"[B, {expected[0]}, {expected[1]}, {expected[2]}]"
        )


def _check_layer(layer: Layer, layout: KVLayout, dtype: torch.dtype, rows: int) -> None:
    """Refuse a layer that is not ``rows`` rows of the layout, in the pages' dtype: reshaped
    into the pages, rows of another shape with as many values would land scrambled."""
    expected = (
        [(rows, layout.values_per_token)]
        if layout.kind == "mla"
        else [(rows, layout.num_kv_heads, layout.head_dim)] * 2
    )
    tensors = [layer] if isinstance(layer, torch.Tensor) else list(layer)
    shapes = [tuple(t.shape) for t in tensors]
    if shapes != expected:
        raise InvalidRequestError(
            f"a layer of shape(s) {shapes} does not fill these pages: expected {expected}"
        )
    for tensor in tensors:
        if tensor.dtype != dtype:
            raise InvalidRequestError(f"a layer of {tensor.dtype} for pages of {dtype}")


def _blocks(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(block_ids), dtype=torch.long, device=device)


def gather_layer(kv_layer: torch.Tensor, block_ids: Sequence[int], layout: KVLayout) -> Layer:
    """The rows of ``block_ids`` (in order) as one tenantkv layer, copied to the CPU."""
    pages = typed_view(kv_layer, layout)
    check_page_shape(pages, layout, pages.shape[2])
    picked = pages.index_select(0, _blocks(block_ids, pages.device))  # [b, H, N, C]
    rows = picked.permute(0, 2, 1, 3).reshape(-1, picked.shape[1], picked.shape[3])  # [T, H, C]
    rows = rows.to("cpu")
    if layout.kind == "mla":
        return rows[:, 0, :].contiguous()
    d = layout.head_dim
    return rows[..., :d].contiguous(), rows[..., d:].contiguous()


def scatter_layer(
    kv_layer: torch.Tensor, block_ids: Sequence[int], layer: Layer, layout: KVLayout
) -> None:
    """Write a loaded layer's rows into the pages ``block_ids`` (block ``i`` of the layer goes
    to page ``block_ids[i]``); every other page is left untouched."""
    pages = typed_view(kv_layer, layout)
    check_page_shape(pages, layout, pages.shape[2])
    blocks, heads, tokens, cell = len(block_ids), pages.shape[1], pages.shape[2], pages.shape[3]
    _check_layer(layer, layout, pages.dtype, blocks * tokens)
    if isinstance(layer, torch.Tensor):
        rows = layer.reshape(-1, 1, cell)
    else:
        rows = torch.cat((layer[0], layer[1]), dim=-1)
    paged = rows.reshape(blocks, tokens, heads, cell).permute(0, 2, 1, 3)
    pages.index_copy_(0, _blocks(block_ids, pages.device), paged.to(pages.device))
