"""Copies between an engine's paged KV cache and tenantkv's per-layer rows (pure torch).

vLLM (and SGLang's host pool) keep each layer's KV in pages of ``block_size`` tokens. vLLM's
per-layer view is ``[num_blocks, H, N, C]`` (blocks first, then head slots, tokens of the
block, and a cell): for MHA/GQA ``H`` is the KV heads and a cell is the head's key followed by
its value (``C = 2 * head_dim``); for MLA ``H`` is 1 and a cell is one latent row
(``kv_lora_rank + rope_dim``). tenantkv keeps a layer as ``(k, v)`` of ``[T, H, D]`` (MHA),
``[T, kv_lora_rank + rope_dim]`` (MLA), or as the pages themselves, ``[T // N, H, N, C]``
(``mha-pages``: the layout vLLM's connector stores, so that a load decrypts into the pages
with no permuted copy). A request's token ``t`` lives in block
``block_ids[t // N]`` at offset ``t % N`` (the slot mapping at block granularity), so gathering
and scattering go a whole block at a time.

Engine-free on purpose: the engine tests and the main suite use the same copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
    elif layout.kind == "mha-pages":
        expected = (layout.num_kv_heads, layout.page_tokens, 2 * layout.head_dim)
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
    expected: list[tuple[int, ...]]
    if layout.kind == "mla":
        expected = [(rows, layout.values_per_token)]
    elif layout.kind == "mha-pages":
        pages = rows // layout.page_tokens
        expected = [(pages, layout.num_kv_heads, layout.page_tokens, 2 * layout.head_dim)]
    else:
        expected = [(rows, layout.num_kv_heads, layout.head_dim)] * 2
    tensors = [layer] if isinstance(layer, torch.Tensor) else list(layer)
    shapes = [tuple(t.shape) for t in tensors]
    if shapes != expected:
        raise InvalidRequestError(
            f"a layer of shape(s) {shapes} does not fill these pages: expected {expected}"
        )
    for tensor in tensors:
        if tensor.dtype != dtype:
            raise InvalidRequestError(f"a layer of {tensor.dtype} for pages of {dtype}")


#: Slices or one indexed copy: each run of consecutive pages is one slice copy per part of a
#: layer (a few microseconds each, one kernel on a GPU), an indexed copy costs about as much
#: as 4 of them at 256 tokens and more at longer prompts (``index_copy_``/``index_select`` are
#: slower per byte than a slice copy). A request is copied as slices while it has at most
#: ``max(MIN_SLICED_RUNS, blocks // 4)`` runs, and never more than ``MAX_SLICED_RUNS``
#: (measured on CPU pages: docs/perf.md, "the engine's KV layout read once").
MIN_SLICED_RUNS = 4
MAX_SLICED_RUNS = 16


def block_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """``block_ids`` as an index tensor on ``device``: built from a Python list, and on a GPU
    copied to the device, so :class:`RequestBlocks` builds it once per request, not per layer."""
    return torch.as_tensor(list(block_ids), dtype=torch.long, device=device)


class RequestBlocks:
    """A request's pages, worked out once for every layer it loads or saves.

    Block ``i`` of the request's rows lives in page ``block_ids[i]``. vLLM mostly hands out
    consecutive pages, so the blocks are kept as runs of consecutive pages (one slice copy
    each, no index tensor); a request scattered over more runs (see :data:`MAX_SLICED_RUNS`)
    is copied with one indexed copy, whose index tensor is built on first use and then reused
    by every layer (per device).
    """

    def __init__(self, block_ids: Sequence[int]) -> None:
        self.block_ids = tuple(int(b) for b in block_ids)
        if self.block_ids and min(self.block_ids) < 0:
            raise InvalidRequestError(f"negative block ids in {self.block_ids}")
        if len(set(self.block_ids)) != len(self.block_ids):
            # two blocks of rows into one page: one would overwrite the other
            raise InvalidRequestError(f"repeated block ids in {self.block_ids}")
        #: (first page, pages, first block of the request), in the request's order
        self.runs: list[tuple[int, int, int]] = []
        for at, page in enumerate(self.block_ids):
            if self.runs and self.runs[-1][0] + self.runs[-1][1] == page:
                first, count, start = self.runs[-1]
                self.runs[-1] = (first, count + 1, start)
            else:
                self.runs.append((page, 1, at))
        limit = min(MAX_SLICED_RUNS, max(MIN_SLICED_RUNS, len(self.block_ids) // 4))
        self.sliced = len(self.runs) <= limit
        self._index: dict[torch.device, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.block_ids)

    def index(self, device: torch.device) -> torch.Tensor:
        """The block ids as an index tensor on ``device`` (built once, then reused)."""
        tensor = self._index.get(device)
        if tensor is None:
            tensor = self._index[device] = block_index(self.block_ids, device)
        return tensor

    def first_rows(self, block_tokens: int) -> list[int]:
        """Each block's first row in pages viewed as ``[pages * block_tokens, C]`` token rows
        (a load's ``block_rows``)."""
        return [page * block_tokens for page in self.block_ids]

    def check_fits(self, num_pages: int) -> None:
        if self.block_ids and max(self.block_ids) >= num_pages:
            raise InvalidRequestError(
                f"block id {max(self.block_ids)} is outside the engine's {num_pages} pages"
            )


def _tensor_key(tensor: torch.Tensor) -> tuple[object, ...]:
    """What makes two tensors the same pages: memory, shape, strides, dtype, device."""
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


class PagedLayer:
    """One layer's pages, viewed and checked once (when the engine registers its caches),
    then copied to and from for every request and every step without re-deriving the view.

    Raises :class:`InvalidRequestError` for pages that do not match the layout: a wrong copy
    would be wrong data.
    """

    def __init__(self, kv_layer: torch.Tensor, layout: KVLayout) -> None:
        if not isinstance(kv_layer, torch.Tensor):
            raise InvalidRequestError(
                f"the engine's KV cache must be a torch.Tensor, got {type(kv_layer).__name__}"
            )
        pages = typed_view(kv_layer, layout)
        check_page_shape(pages, layout, pages.shape[2])
        self.key = _tensor_key(kv_layer)
        self.layout = layout
        self.pages = pages  # [B, H, N, C]
        self.num_pages, self.heads, self.block_tokens, self.cell = pages.shape
        # The page tensors a layer's parts go to: MLA's one tensor (or mha-pages' pages) to the
        # pages, MHA's k and v to their halves of each cell ([B, H, N, D] views of [B, H, N, 2,
        # D]).
        self._as_pages = layout.kind == "mha-pages"  # a layer is already [P, H, N, C] pages
        # A kind whose layer is its stored rows in one tensor (MLA, mha-pages) lies in the
        # pages as it is stored.
        as_rows = layout.strategy.decrypts_into_out
        if as_rows:
            self._parts = [pages]
        else:
            cells = pages.view(*pages.shape[:3], 2, layout.head_dim)
            self._parts = [cells[..., 0, :], cells[..., 1, :]]
        #: The pages as ``[pages * N, token values]`` rows, when a layer's rows lie in them as
        #: tenantkv stores them (MLA or mha-pages pages, contiguous): a load can then decrypt
        #: straight into the pages (``Namespace.load(out=, block_rows=)``), with no layer
        #: tensor between. MHA pages keep each head's tokens together, so an ``mha`` token's
        #: row is not contiguous in them.
        self.rows: torch.Tensor | None = None
        if as_rows and pages.is_contiguous():
            self.rows = pages.view(self.num_pages * self.block_tokens, layout.values_per_token)

    def same_pages(self, kv_layer: Any) -> bool:
        """Whether ``kv_layer`` is the memory this view was built over (a step may hand the
        registered pages again, or another view of them)."""
        return isinstance(kv_layer, torch.Tensor) and _tensor_key(kv_layer) == self.key

    def check_blocks(self, blocks: RequestBlocks) -> None:
        """Refuse a request whose pages lie outside these (InvalidRequestError)."""
        blocks.check_fits(self.num_pages)

    def _as_blocks(self, rows: torch.Tensor, count: int) -> torch.Tensor:
        """``[T, H, C]`` rows as ``[count, H, N, C]`` (the pages' axis order; a view); a
        layer that is pages already stays as it is."""
        if self._as_pages:
            return rows
        return rows.view(count, self.block_tokens, *rows.shape[1:]).transpose(1, 2)

    def write(self, blocks: RequestBlocks, layer: Layer, *, skip_blocks: int = 0) -> None:
        """Write a loaded layer's rows into the request's pages (block ``skip_blocks + i`` of
        the layer goes to page ``block_ids[i]``: the layer's first ``skip_blocks`` blocks are
        pages the engine has already); every other page is left untouched. For a layer of the
        whole prefix: a layer loaded with ``Namespace.load(skip_blocks=)`` already starts after
        the engine's blocks (the vLLM connector's case) and is written with ``skip_blocks=0``."""
        blocks.check_fits(self.num_pages)
        count = len(blocks)
        if skip_blocks:  # views, no copy
            skip = skip_blocks if self._as_pages else skip_blocks * self.block_tokens
            layer = (
                layer[skip:]
                if isinstance(layer, torch.Tensor)
                else (layer[0][skip:], layer[1][skip:])
            )
        _check_layer(layer, self.layout, self.pages.dtype, count * self.block_tokens)
        if isinstance(layer, torch.Tensor):
            sources = [layer if self._as_pages else layer.unsqueeze(1)]
        else:
            sources = list(layer)
        for pages, rows in zip(self._parts, sources, strict=True):
            paged = self._as_blocks(rows.to(pages.device), count)
            if blocks.sliced:
                for first, length, at in blocks.runs:
                    pages[first : first + length].copy_(paged[at : at + length])
            else:
                pages.index_copy_(0, blocks.index(pages.device), paged)

    def read(self, blocks: RequestBlocks) -> Layer:
        """The rows of the request's pages (in order) as one tenantkv layer on the CPU, each
        part contiguous, copied once."""
        blocks.check_fits(self.num_pages)
        count = len(blocks)
        rows, dtype = count * self.block_tokens, self.pages.dtype
        outs: list[torch.Tensor]
        result: Layer
        if self._as_pages:
            result = torch.empty((count, *self.pages.shape[1:]), dtype=dtype)
            outs = [result]
        elif self.layout.kind == "mla":
            result = torch.empty(rows, self.cell, dtype=dtype)
            outs = [result.unsqueeze(1)]
        else:
            shape = (rows, self.heads, self.layout.head_dim)
            k, v = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
            outs, result = [k, v], (k, v)
        for pages, out in zip(self._parts, outs, strict=True):
            paged = self._as_blocks(out, count)
            if blocks.sliced:
                for first, length, at in blocks.runs:
                    paged[at : at + length].copy_(pages[first : first + length])
            else:
                paged.copy_(pages.index_select(0, blocks.index(pages.device)))
        return result


def gather_layer(kv_layer: torch.Tensor, block_ids: Sequence[int], layout: KVLayout) -> Layer:
    """The rows of ``block_ids`` (in order) as one tenantkv layer, copied to the CPU.

    One-off form of :meth:`PagedLayer.read`; the vLLM connector keeps its views and blocks."""
    return PagedLayer(kv_layer, layout).read(RequestBlocks(block_ids))


def scatter_layer(
    kv_layer: torch.Tensor, block_ids: Sequence[int], layer: Layer, layout: KVLayout
) -> None:
    """Write a loaded layer's rows into the pages ``block_ids`` (block ``i`` of the layer goes
    to page ``block_ids[i]``); every other page is left untouched.

    One-off form of :meth:`PagedLayer.write`; the vLLM connector keeps its views and blocks."""
    PagedLayer(kv_layer, layout).write(RequestBlocks(block_ids), layer)
