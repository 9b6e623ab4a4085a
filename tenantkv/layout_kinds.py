"""Layout kinds as strategies, registered by name.

Each kind says how one layer of its models' caches is shaped and maps to bytes: how a caller's
layer becomes rows of ``token_bytes``, how loaded bytes become the caller's layer (views, no
copy), how ``out=`` buffers are checked and filled. :class:`~tenantkv.layout.KVLayout` and the
loader ask the kind; nothing else branches on it, so a new kind (a quantised codec, a model
family with another cache shape) is one class registered here.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .codecs import Component
from .errors import InvalidRequestError
from .tensor_checks import check_dense

Layer = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
#: Moves a layer's position-carrying part (``[T, ..., D]``, rotated keys) to new positions.
KeyMover = Callable[[torch.Tensor], torch.Tensor]


class KVLayout(Protocol):
    """What a kind reads of a layout (``tenantkv.layout.KVLayout`` provides it)."""

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def rope_dim(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def page_tokens(self) -> int: ...
    @property
    def values_per_token(self) -> int: ...
    @property
    def token_bytes(self) -> int: ...


def check_tensor(layout: KVLayout, what: str, tensor: Any, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequestError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    check_dense(what, tensor)
    if tensor.dtype != layout.dtype:
        raise InvalidRequestError(
            f"{what} has dtype {tensor.dtype}, the layout says {layout.dtype}"
        )
    if tuple(tensor.shape) != shape:
        raise InvalidRequestError(
            f"{what} has shape {list(tensor.shape)}, the layout expects {list(shape)}"
        )
    return tensor


def _pair(what: str, entry: Any) -> tuple[Any, Any]:
    if not isinstance(entry, Sequence) or isinstance(entry, torch.Tensor) or len(entry) != 2:
        raise InvalidRequestError(f"{what} must be a (k, v) pair of tensors")
    return entry[0], entry[1]


class LayoutKind(abc.ABC):
    """How layers of one kind of KV cache are shaped and stored."""

    #: The name in ``KVLayout.kind`` and in the namespace fingerprint.
    name: str
    #: Whether a load may decrypt straight into the caller's ``out=`` buffers (their bytes are
    #: laid out as stored); otherwise chunks are staged and split into them.
    decrypts_into_out: bool

    @abc.abstractmethod
    def values_per_token(self, layout: KVLayout) -> int:
        """Values of one token in one layer."""

    @abc.abstractmethod
    def shape_fields(self, layout: KVLayout) -> dict[str, int]:
        """The kind's own dimensions, for the layout's canonical description."""

    @abc.abstractmethod
    def components(self, layout: KVLayout) -> list[Component]:
        """The parts of a token's row that a codec scales apart (``tenantkv.codecs``), in row
        order; what a lossy codec stores of them sets the layout's encoded segment size."""

    @abc.abstractmethod
    def layer_rows(self, layout: KVLayout, layer: Any, what: str, num_tokens: int) -> torch.Tensor:
        """A caller's layer, checked, as a contiguous CPU tensor of the layout's dtype whose
        bytes are the stored rows."""

    @abc.abstractmethod
    def layer_from_values(self, layout: KVLayout, values: torch.Tensor, num_tokens: int) -> Layer:
        """Typed views of a loaded layer's values (contiguous, the layout's dtype; no copy)."""

    @abc.abstractmethod
    def out_parts(self, entry: Any, what: str, check: Any) -> tuple[Any, list[torch.Tensor]]:
        """Check one ``out=`` entry with ``check(what, tensor, tail_shape)``; return the entry as
        the stream yields it and its tensors (to refuse buffers that share memory)."""

    @abc.abstractmethod
    def out_tail(self, layout: KVLayout) -> tuple[int, ...]:
        """The shape of one token's row in an ``out=`` tensor."""

    @abc.abstractmethod
    def reposition(
        self, layout: KVLayout, layer: Layer, kept: torch.Tensor, move: KeyMover
    ) -> Layer:
        """The rows ``kept`` of ``layer`` (a new layer), with only the part that carries
        positions passed through ``move``; every other value is copied byte for byte."""

    def out_rows(self, layout: KVLayout, entry: Any) -> torch.Tensor | None:
        """An ``out=`` entry as ``[R, token_bytes]`` uint8 rows, when loads decrypt into it."""
        return None

    def check_block_tokens(self, layout: KVLayout, block_tokens: int) -> None:
        """Refuse (InvalidRequestError) a namespace block size this kind cannot store; every
        size is fine unless a kind says otherwise."""
        return None

    def out_pair(self, entry: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An ``out=`` entry's (k, v) tensors, when staged chunks are split into them."""
        return None

    def split_rows(
        self, layout: KVLayout, rows: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Staged ``[length, token_bytes]`` rows as (k, v) views, for :meth:`out_pair`."""
        raise NotImplementedError(f"{self.name} layers are not split")


class RowsKind(LayoutKind):
    """A kind whose layer is one tensor holding the stored rows as they are: ``out=`` buffers
    are ``[R, values_per_token]`` rows a load decrypts straight into."""

    decrypts_into_out = True

    def out_tail(self, layout: KVLayout) -> tuple[int, ...]:
        return (layout.values_per_token,)

    def out_parts(self, entry: Any, what: str, check: Any) -> tuple[Any, list[torch.Tensor]]:
        tensor = check(what, entry)
        return tensor, [tensor]

    def out_rows(self, layout: KVLayout, entry: Any) -> torch.Tensor | None:
        return entry.view(torch.uint8).view(entry.shape[0], layout.token_bytes)  # type: ignore[no-any-return]


class LatentKind(RowsKind):
    """MLA (DeepSeek-V2/V3): per token one latent ``c_KV`` and one decoupled RoPE key ``k_pe``;
    a layer is one tensor ``[T, kv_lora_rank + rope_dim]``."""

    name = "mla"

    def values_per_token(self, layout: KVLayout) -> int:
        return layout.kv_lora_rank + layout.rope_dim

    def shape_fields(self, layout: KVLayout) -> dict[str, int]:
        return {"kv_lora_rank": layout.kv_lora_rank, "rope_dim": layout.rope_dim}

    def components(self, layout: KVLayout) -> list[Component]:
        rank, rope = layout.kv_lora_rank, layout.rope_dim
        return [
            Component("c_kv", 0, rank, rank, positional=False),
            Component("k_rot", rank, rope, rope, positional=True),
        ]

    def layer_rows(self, layout: KVLayout, layer: Any, what: str, num_tokens: int) -> torch.Tensor:
        tensor = check_tensor(layout, what, layer, (num_tokens, layout.values_per_token))
        return tensor.detach().to("cpu").contiguous()

    def layer_from_values(self, layout: KVLayout, values: torch.Tensor, num_tokens: int) -> Layer:
        return values.view(num_tokens, layout.values_per_token)

    def reposition(
        self, layout: KVLayout, layer: Layer, kept: torch.Tensor, move: KeyMover
    ) -> Layer:
        # Only k_pe carries a position; c_KV is position-free and stays as it is.
        assert isinstance(layer, torch.Tensor), "an MLA layer is one tensor"
        rows = layer[kept.to(layer.device)]
        rank = layout.kv_lora_rank
        rows[:, rank:] = move(rows[:, rank:])
        return rows


class KeyValueKind(LayoutKind):
    """MHA/GQA (Llama, Qwen): a layer is a pair ``(k, v)``, each ``[T, num_kv_heads,
    head_dim]``. A token's stored row is ``k_t || v_t``, so a loaded layer is one buffer
    ``[T, 2, H, D]`` and ``k``/``v`` are views into it."""

    name = "mha"
    decrypts_into_out = False

    def values_per_token(self, layout: KVLayout) -> int:
        return 2 * layout.num_kv_heads * layout.head_dim

    def shape_fields(self, layout: KVLayout) -> dict[str, int]:
        return {"num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim}

    def components(self, layout: KVLayout) -> list[Component]:
        # A token's row is k_t || v_t, each num_kv_heads vectors of head_dim values. K carries
        # RoPE too, but per head: its rotation is the head's, so it is coded like V.
        width = layout.num_kv_heads * layout.head_dim
        return [
            Component("k", 0, width, layout.head_dim, positional=False),
            Component("v", width, width, layout.head_dim, positional=False),
        ]

    def layer_rows(self, layout: KVLayout, layer: Any, what: str, num_tokens: int) -> torch.Tensor:
        k, v = _pair(what, layer)
        shape = (num_tokens, layout.num_kv_heads, layout.head_dim)
        k = check_tensor(layout, f"{what} k", k, shape)
        v = check_tensor(layout, f"{what} v", v, shape)
        if k.device != v.device:
            raise InvalidRequestError(f"{what}: k and v are on different devices")
        return torch.stack((k.detach(), v.detach()), dim=1).to("cpu")

    def layer_from_values(self, layout: KVLayout, values: torch.Tensor, num_tokens: int) -> Layer:
        pair = values.view(num_tokens, 2, layout.num_kv_heads, layout.head_dim)
        return pair[:, 0], pair[:, 1]

    def out_tail(self, layout: KVLayout) -> tuple[int, ...]:
        return (layout.num_kv_heads, layout.head_dim)

    def reposition(
        self, layout: KVLayout, layer: Layer, kept: torch.Tensor, move: KeyMover
    ) -> Layer:
        # K carries the rotation; V never does.
        k, v = _pair("layer", layer)
        index = kept.to(k.device)
        return move(k[index]), v[index]

    def out_parts(self, entry: Any, what: str, check: Any) -> tuple[Any, list[torch.Tensor]]:
        k, v = _pair(what, entry)
        parts = [check(f"{what} k", k), check(f"{what} v", v)]
        return entry, parts

    def out_pair(self, entry: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        return entry[0], entry[1]

    def split_rows(
        self, layout: KVLayout, rows: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pair = rows.view(layout.dtype).view(length, 2, layout.num_kv_heads, layout.head_dim)
        return pair[:, 0], pair[:, 1]


class PagedKeyValueKind(RowsKind):
    """MHA/GQA as an engine pages it (vLLM's CPU backend): a layer is whole pages ``[P, H, N,
    2 * D]`` of ``N = page_tokens`` tokens, where a page keeps each KV head's tokens together and
    a token's cell is its key then its value.

    Stored as the pages' own bytes: "row" ``r`` of a layer is bytes ``r * token_bytes ..`` of
    its pages, so a block of ``N`` rows is one page, and an engine's pages viewed as ``[pages *
    N, token_bytes]`` rows take a load's decryption directly (the MLA path), where
    :class:`KeyValueKind` rows (one token each, ``k_t || v_t``) need a permuted copy into such
    pages. A row is not one token: a namespace of this kind holds whole pages only
    (:meth:`check_block_tokens`), and its layers cannot be repositioned (:meth:`reposition`)."""

    name = "mha-pages"

    def values_per_token(self, layout: KVLayout) -> int:
        return 2 * layout.num_kv_heads * layout.head_dim

    def shape_fields(self, layout: KVLayout) -> dict[str, int]:
        return {
            "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim,
            "page_tokens": layout.page_tokens,
        }

    def components(self, layout: KVLayout) -> list[Component]:
        # A row is num_kv_heads cells (of consecutive tokens of one head, or of the page's
        # layout where page_tokens is not a multiple of the heads), each key then value: the
        # keys and the values of each cell position are scaled apart, as KeyValueKind keeps
        # k and v apart.
        d = layout.head_dim
        parts = []
        for cell in range(layout.num_kv_heads):
            parts.append(Component(f"k{cell}", 2 * d * cell, d, d, positional=False))
            parts.append(Component(f"v{cell}", 2 * d * cell + d, d, d, positional=False))
        return parts

    def _shape(self, layout: KVLayout, what: str, num_tokens: int) -> tuple[int, ...]:
        pages, rest = divmod(num_tokens, layout.page_tokens)
        if rest:
            raise InvalidRequestError(
                f"{what} covers {num_tokens} tokens, not whole pages of {layout.page_tokens}"
            )
        return (pages, layout.num_kv_heads, layout.page_tokens, 2 * layout.head_dim)

    def layer_rows(self, layout: KVLayout, layer: Any, what: str, num_tokens: int) -> torch.Tensor:
        tensor = check_tensor(layout, what, layer, self._shape(layout, what, num_tokens))
        return tensor.detach().to("cpu").contiguous()

    def layer_from_values(self, layout: KVLayout, values: torch.Tensor, num_tokens: int) -> Layer:
        return values.view(self._shape(layout, "a loaded layer", num_tokens))

    def reposition(
        self, layout: KVLayout, layer: Layer, kept: torch.Tensor, move: KeyMover
    ) -> Layer:
        raise InvalidRequestError(
            "layers kept as an engine's pages ('mha-pages') cannot be edited: their rows are "
            "not tokens"
        )

    def check_block_tokens(self, layout: KVLayout, block_tokens: int) -> None:
        if block_tokens % layout.page_tokens:
            raise InvalidRequestError(
                f"block_tokens {block_tokens} is not whole pages of {layout.page_tokens} tokens "
                "(layout 'mha-pages')"
            )


_KINDS: dict[str, LayoutKind] = {}


def register_layout_kind(kind: LayoutKind) -> None:
    """Make ``kind`` available to :class:`~tenantkv.layout.KVLayout` by its name."""
    if kind.name in _KINDS:
        raise ValueError(f"a layout kind named {kind.name!r} is already registered")
    _KINDS[kind.name] = kind


def layout_kind(name: str) -> LayoutKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise InvalidRequestError(
            f"unknown layout kind {name!r}; registered: {', '.join(sorted(_KINDS))}"
        ) from None


register_layout_kind(LatentKind())
register_layout_kind(KeyValueKind())
register_layout_kind(PagedKeyValueKind())
