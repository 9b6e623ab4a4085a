"""KV layouts: how one layer of a prefix cache is shaped, and how it maps to bytes.

Three layout kinds are registered (``tenantkv.layout_kinds``; more can be):

* **MLA** (DeepSeek-V2/V3): per token and layer one latent ``c_KV`` (``kv_lora_rank`` values) and
  one decoupled RoPE key ``k_pe`` (``rope_dim`` values). A layer is one tensor
  ``[T, kv_lora_rank + rope_dim]``.
* **MHA/GQA** (Llama, Qwen): a layer is a pair ``(k, v)``, each ``[T, num_kv_heads, head_dim]``.
  On disk a token's row is ``k_t || v_t``, so a loaded layer is one buffer ``[T, 2, H, D]`` and
  ``k``/``v`` are zero-copy views into it.
* **MHA/GQA in an engine's pages** (``mha-pages``): the same values kept as vLLM's CPU backend
  pages them, whole pages of ``page_tokens`` tokens, each ``[H, page_tokens, 2, D]`` (per KV
  head, per token, key then value). A layer is ``[T // page_tokens, H, page_tokens, 2 * D]``.
  An engine that stores its pages this way loads them back by decrypting straight into its
  pages: no permuted copy between tenantkv's token rows and the engine's head-major pages.

Every layout holds a fixed number of bytes per token and layer (:attr:`KVLayout.token_bytes`,
the caller's dtype). What is stored of a block of one layer is a fixed-size segment
(:meth:`KVLayout.segment_bytes`): the same bytes under codec ``none``, fewer under a lossy codec
(``tenantkv.codecs``: ``fp8``, ``int4``), which a namespace chooses with ``codec=``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .codecs import Codec, Component, check_finite
from .codecs import codec as codec_named
from .errors import InvalidRequestError
from .layout_kinds import Layer as Layer
from .layout_kinds import LayoutKind, layout_kind

SUPPORTED_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class KVLayout:
    """The shape and dtype of one model's per-layer KV cache. Build with :meth:`mla`/:meth:`mha`."""

    kind: str
    num_layers: int
    dtype: torch.dtype
    kv_lora_rank: int = 0
    rope_dim: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    #: Tokens of one page (``mha-pages`` only): a stored block is whole pages.
    page_tokens: int = 0
    #: How the values are stored (``tenantkv.codecs``); set by ``kv.namespace(codec=)``.
    codec: str = "none"

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> KVLayout:
        _positive("num_layers", num_layers)
        _positive("kv_lora_rank", kv_lora_rank)
        _positive("rope_dim", rope_dim)
        cls._check_dtype(dtype)
        return cls("mla", num_layers, dtype, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)

    @classmethod
    def mha(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> KVLayout:
        _positive("num_layers", num_layers)
        _positive("num_kv_heads", num_kv_heads)
        _positive("head_dim", head_dim)
        cls._check_dtype(dtype)
        return cls("mha", num_layers, dtype, num_kv_heads=num_kv_heads, head_dim=head_dim)

    @classmethod
    def mha_pages(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_tokens: int,
        dtype: torch.dtype,
    ) -> KVLayout:
        """MHA/GQA values in an engine's pages of ``page_tokens`` tokens (``mha-pages``): a
        namespace of this layout stores blocks of whole pages (``block_tokens`` a multiple of
        ``page_tokens``). Another kind than :meth:`mha`, so another namespace: token rows and
        pages of the same values never meet."""
        _positive("num_layers", num_layers)
        _positive("num_kv_heads", num_kv_heads)
        _positive("head_dim", head_dim)
        _positive("page_tokens", page_tokens)
        cls._check_dtype(dtype)
        return cls(
            "mha-pages",
            num_layers,
            dtype,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_tokens=page_tokens,
        )

    @staticmethod
    def _check_dtype(dtype: torch.dtype) -> None:
        if dtype not in SUPPORTED_DTYPES:
            names = ", ".join(SUPPORTED_DTYPES.values())
            raise InvalidRequestError(f"dtype {dtype} is not supported; use one of {names}")

    def with_codec(self, name: str) -> KVLayout:
        """This layout stored under codec ``name``; InvalidRequestError for an unknown codec
        or one that cannot code this layout."""
        chosen = codec_named(name)
        chosen.check(self)
        return dataclasses.replace(self, codec=chosen.name)

    @functools.cached_property
    def coder(self) -> Codec:
        """The codec object that encodes and decodes this layout's segments."""
        return codec_named(self.codec)

    @property
    def encoded(self) -> bool:
        """Whether stored segments are codes rather than the values' own bytes."""
        return self.codec != "none"

    def components(self) -> list[Component]:
        """The parts of a token's row that a codec scales apart."""
        return self.strategy.components(self)

    def check_block_tokens(self, block_tokens: int) -> None:
        """InvalidRequestError when a namespace of this layout cannot use blocks of
        ``block_tokens`` tokens (``mha-pages``: a block must be whole pages)."""
        self.strategy.check_block_tokens(self, block_tokens)

    def segment_bytes(self, block_tokens: int) -> int:
        """Stored (plaintext) bytes of one block of one layer, under this layout's codec."""
        return self.coder.segment_bytes(self, block_tokens)

    def encode_rows(self, rows: torch.Tensor, block_tokens: int) -> torch.Tensor:
        """A validated layer (``[T, token_bytes]`` uint8) as stored segments: the rows as they
        are under codec ``none``, else ``[T // block_tokens, segment_bytes]`` codes of the
        layer's full blocks (a partial last block is never stored)."""
        if not self.encoded:
            return rows
        full = rows.shape[0] // block_tokens * block_tokens
        values = rows[:full].view(self.dtype)
        # layer_rows refused non-finite values already: the one check of a store.
        return self.coder.encode(self, values, block_tokens, checked=True)

    def decode_rows(self, codes: torch.Tensor, block_tokens: int) -> torch.Tensor:
        """Stored segments (``[n, segment_bytes]`` uint8, on any device) as ``[n *
        block_tokens, token_bytes]`` uint8 rows of this layout's dtype, on the same device."""
        values = self.coder.decode(self, codes, block_tokens)
        return values.view(torch.uint8).view(-1, self.token_bytes)

    # Cached: the loader asks for these per chunk. (A frozen dataclass without slots keeps a
    # cached_property's value in the instance dict; fields, equality and hashing are unchanged.)
    @functools.cached_property
    def strategy(self) -> LayoutKind:
        """The registered kind that knows this layout's shapes."""
        return layout_kind(self.kind)

    @functools.cached_property
    def values_per_token(self) -> int:
        """Values of one token in one layer."""
        return self.strategy.values_per_token(self)

    @functools.cached_property
    def token_bytes(self) -> int:
        """Bytes of one token in one layer."""
        return self.values_per_token * self.dtype.itemsize

    def describe(self) -> dict[str, Any]:
        """A canonical description, hashed into the namespace's model fingerprint."""
        info: dict[str, Any] = {
            "kind": self.kind,
            "num_layers": self.num_layers,
            "dtype": SUPPORTED_DTYPES[self.dtype],
        }
        info.update(self.strategy.shape_fields(self))
        if self.encoded:  # absent for "none": fingerprints from before codecs stay the same
            info["codec"] = self.codec
        return info

    # ---- tensors <-> bytes -------------------------------------------------------------------

    def layer_rows(self, layer: Any, index: int, num_tokens: int) -> torch.Tensor:
        """Validate one layer of ``num_tokens`` tokens; return it as ``[T, token_bytes]`` uint8."""
        values = self.strategy.layer_rows(self, layer, f"layer {index}", num_tokens)
        if self.coder.lossy:
            check_finite(self.codec, values)
        return values.view(torch.uint8).reshape(num_tokens, self.token_bytes)

    def validate_layers(self, layers: Any, num_tokens: int) -> list[torch.Tensor]:
        """All layers as ``[T, token_bytes]`` uint8 CPU tensors, or InvalidRequestError."""
        if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
            raise InvalidRequestError(
                f"layers must be a sequence of {self.num_layers} per-layer entries"
            )
        if len(layers) != self.num_layers:
            raise InvalidRequestError(f"got {len(layers)} layers, the layout has {self.num_layers}")
        return [self.layer_rows(layer, i, num_tokens) for i, layer in enumerate(layers)]

    def empty_rows(self, num_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """An uninitialised ``[T, token_bytes]`` uint8 buffer for one loaded layer."""
        return torch.empty((num_tokens, self.token_bytes), dtype=torch.uint8, device=device)

    def layer_from_rows(self, rows: torch.Tensor) -> Layer:
        """Typed views of a loaded ``[T, token_bytes]`` uint8 buffer (no copy)."""
        return self.layer_from_values(rows.view(self.dtype), rows.shape[0])

    def layer_from_values(self, values: torch.Tensor, num_tokens: int) -> Layer:
        """Typed views of a loaded layer's ``num_tokens`` tokens, given as a contiguous tensor of
        this layout's dtype (flat or one row per token), with no copy."""
        return self.strategy.layer_from_values(self, values, num_tokens)
