"""Hugging Face transformers: save a request's prefix cache, restore the longest cached prefix.

::

    from tenantkv.integrations.transformers import PrefixCache

    prefixes = PrefixCache(kv, "acme", model)            # namespace from the model's config
    restored = prefixes.restore(input_ids)                # longest cached prefix, or a miss
    output = model.generate(
        input_ids, cache=restored.cache, max_new_tokens=64, return_dict_in_generate=True
    )
    prefixes.save(output.sequences[0], output.cache)     # the new full blocks, sealed

Layouts. In transformers 5 the DeepSeek-V3 attention caches the MLA latent itself: a layer's
keys are the normed ``c_KV`` ``[B, 1, T, kv_lora_rank]`` and its values the rotated ``k_rot``
``[B, 1, T, qk_rope_head_dim]``, which is the layout DeepSeek keeps on disk; tenantkv stores
them as one MLA row ``c_KV || k_rot`` per token. Llama- and Qwen-style models cache per-head
keys and values ``[B, H_kv, T, D]``, stored as the MHA layout. Models whose cache is not one
full-attention layer per decoder layer (sliding windows, chunked attention, linear attention,
shared KV) are refused: their caches cannot be cut at an arbitrary 64-token boundary.

Model identity. The namespace's fingerprint is made from the model's name, its hub revision
(the commit hash when loaded from the hub) and a SHA-256 of its configuration, plus the KV
layout and dtype, so a cache written by one model never serves another with a different
architecture, checkpoint revision or dtype. Weights are not hashed: two local checkpoints with
the same name and configuration but different weights (a fine-tune saved under the same name)
must be told apart with ``revision=``.

Editing (agents). :meth:`PrefixCache.edit` drops token spans from a restored cache and moves
the retained keys to contiguous positions (:mod:`tenantkv.editing`); the model then computes the
rest of the edited token sequence on top of it, and :meth:`PrefixCache.save` with the edit's
``origin`` stores the edited conversation on its own key chain, which later turns restore with
the same ``origin``. The RoPE frequencies are the model's own (:func:`rope_for`).

Only batch size 1 is handled: a prefix cache belongs to one request's tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

try:
    from transformers import DynamicCache, PreTrainedModel
    from transformers.cache_utils import Cache, get_layer_types_and_kwargs
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "tenantkv.integrations.transformers needs transformers: pip install 'tenantkv[hf]'"
    ) from err

from ..api import TenantKV
from ..editing import EditedPrefix, EditScript, RopeSpec, edit_layer
from ..errors import CacheMissError, InvalidRequestError, LoadError
from ..layout import KVLayout, Layer
from ..retention import DEFAULT_KIND
from ..services.namespace import Namespace
from ..tokens import as_token_array
from .streamed_layer import LayerFeed, streamed_cache

logger = logging.getLogger("tenantkv")

# Model types whose attention caches the MLA latent (keys = c_KV, values = k_rot), checked
# against the modeling code of the pinned transformers range. Other MLA models (DeepSeek-V2
# caches per-head k_nope, for instance) do not cache the latent and are refused.
_LATENT_MODEL_TYPES = frozenset({"deepseek_v3"})

# Configuration fields that do not change what a model computes, so they do not split caches.
_VOLATILE_CONFIG_FIELDS = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "_attn_implementation",
        "_attn_implementation_internal",
        "_attn_implementation_autoset",
        "_experts_implementation",
        "architectures",
    }
)

_MAX_LABEL = 256


def _decoder_config(model: PreTrainedModel) -> Any:
    if not isinstance(model, PreTrainedModel):
        raise InvalidRequestError(
            f"model must be a transformers PreTrainedModel, got {type(model).__name__}"
        )
    return model.config.get_text_config(decoder=True)


def config_digest(model: PreTrainedModel) -> str:
    """SHA-256 (hex) of the model's configuration, less the fields that do not change outputs."""
    settings = {
        key: value
        for key, value in model.config.to_dict().items()
        if key not in _VOLATILE_CONFIG_FIELDS
    }
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def model_identity(model: PreTrainedModel, revision: str | None = None) -> tuple[str, str]:
    """The ``(model, revision)`` labels of the namespace for ``model``.

    ``model`` is the hub name (or the model type of a model built from a configuration);
    ``revision`` joins the given revision (or the hub commit, or ``"local"``) with the config
    digest, so any change of architecture or hyper-parameters gives another fingerprint.
    """
    config = _decoder_config(model)
    name = str(getattr(model.config, "name_or_path", "") or config.model_type)
    source = revision or getattr(model.config, "_commit_hash", None) or "local"
    label = f"{source}+config-sha256:{config_digest(model)}"
    if len(name) > _MAX_LABEL or len(label) > _MAX_LABEL:
        raise InvalidRequestError(f"model name and revision must be at most {_MAX_LABEL} chars")
    return name, label


def layout_for(model: PreTrainedModel) -> KVLayout:
    """The tenantkv layout of ``model``'s ``DynamicCache``, or InvalidRequestError."""
    config = _decoder_config(model)
    layer_types, _ = get_layer_types_and_kwargs(config)
    unsupported = sorted({kind for kind in layer_types if kind != "full_attention"})
    if unsupported:
        raise InvalidRequestError(
            f"{config.model_type} has {', '.join(unsupported)} layers; only models whose every "
            "layer caches full attention can be restored from a prefix"
        )
    dtype = model.dtype
    num_layers = len(layer_types)
    if config.model_type in _LATENT_MODEL_TYPES:
        return KVLayout.mla(num_layers, config.kv_lora_rank, config.qk_rope_head_dim, dtype)
    if getattr(config, "kv_lora_rank", None):
        raise InvalidRequestError(
            f"{config.model_type} uses latent attention with a cache layout tenantkv does not "
            f"know; supported latent models: {', '.join(sorted(_LATENT_MODEL_TYPES))}"
        )
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVLayout.mha(num_layers, int(heads), int(head_dim), dtype)


# RoPE types whose frequencies depend on the sequence length: a cached key cannot be moved by
# one rotation, since the frequencies it was rotated with change as the sequence grows.
_DYNAMIC_ROPE_TYPES = frozenset({"dynamic", "longrope"})


def rope_for(model: PreTrainedModel) -> RopeSpec:
    """The RoPE of ``model``'s cached keys: the frequencies its rotary embedding was built with
    from its configuration (base, rotary dimensions, and any static scaling such as linear,
    YaRN or Llama 3), in the half-split pair layout.

    Half-split for every transformers model, DeepSeek-V3 included: its interleaved rotation
    (``rope_interleave``) reads interleaved pairs but writes the rotated ``k_rot`` it caches
    de-interleaved. Refuses length-dependent scalings (dynamic NTK, LongRoPE).
    """
    _decoder_config(model)
    rotary = next(
        (
            module
            for module in model.modules()
            if isinstance(getattr(module, "inv_freq", None), torch.Tensor)
        ),
        None,
    )
    if rotary is None:
        raise InvalidRequestError(f"{type(model).__name__} has no rotary embedding to shift")
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if rope_type in _DYNAMIC_ROPE_TYPES:
        raise InvalidRequestError(
            f"{rope_type} RoPE changes its frequencies with the sequence length; cached keys "
            "cannot be repositioned exactly"
        )
    # inv_freq as built from the config (a dynamic update may have replaced the buffer since)
    frequencies = getattr(rotary, "original_inv_freq", None)
    if not isinstance(frequencies, torch.Tensor):
        frequencies = getattr(rotary, "inv_freq")  # noqa: B009 - nn.Module attributes are Any
    return RopeSpec.from_frequencies(frequencies.detach().to("cpu", torch.float32))


@dataclass(frozen=True)
class RestoredPrefix:
    """What :meth:`PrefixCache.restore` found: ``num_tokens`` cached tokens in ``cache``.

    On a miss ``cache`` is ``None`` and ``num_tokens`` is 0; pass ``cache`` to ``generate`` or
    ``forward`` (``cache=``) together with the whole prompt, and the model computes only the
    tokens after ``num_tokens``.
    """

    cache: DynamicCache | None
    num_tokens: int
    #: The edited prefix this cache belongs to (None: an unedited prefix).
    origin: EditedPrefix | None = None

    @property
    def hit(self) -> bool:
        return self.num_tokens > 0


@dataclass(frozen=True)
class EditedRestore:
    """What :meth:`PrefixCache.edit` made: ``cache`` holds the first ``num_tokens`` tokens of
    ``tokens`` (the edited token sequence, ``[1, T]``). Pass both to the model; save the result
    with ``origin=origin``, and restore later turns with it."""

    cache: DynamicCache | None
    num_tokens: int
    tokens: torch.Tensor
    origin: EditedPrefix | None


class PrefixCache:
    """Prefix caches of one transformers model in one tenant's (optionally scoped) namespace."""

    def __init__(
        self,
        kv: TenantKV,
        tenant: str,
        model: PreTrainedModel,
        *,
        scope: str | None = None,
        revision: str | None = None,
        codec: str = "none",
    ) -> None:
        """``codec`` is how the namespace stores the caches (``tenantkv.codecs``: ``"none"``,
        byte-exact; ``"fp8"``, ``"int4"``, lossy): restores return the model's dtype."""
        self.model = model
        name, label = model_identity(model, revision)
        self.namespace: Namespace = kv.namespace(
            tenant, model=name, revision=label, layout=layout_for(model), scope=scope, codec=codec
        )
        self.layout = self.namespace.layout
        self._strict = kv.config.strict
        self._rope: RopeSpec | None = None

    @property
    def rope(self) -> RopeSpec:
        """The model's RoPE (:func:`rope_for`), found on first use: a model whose RoPE cannot
        be shifted still saves and restores, it only cannot be edited."""
        if self._rope is None:
            self._rope = rope_for(self.model)
        return self._rope

    def __repr__(self) -> str:
        return f"PrefixCache({self.namespace!r})"

    # ---- save ---------------------------------------------------------------------------------

    def save(
        self,
        tokens: Any,
        cache: Cache,
        *,
        kind: str = DEFAULT_KIND,
        origin: EditedPrefix | None = None,
    ) -> int:
        """Store the full 64-token blocks of ``tokens`` that ``cache`` holds and are new.

        ``tokens`` are the request's token ids (a list, a 1-D tensor, or a ``[1, T]`` tensor such
        as ``generate``'s output sequences), of which ``cache`` holds the first
        ``cache.get_seq_length()``. Returns the number of tokens newly stored (see
        :meth:`tenantkv.Namespace.store`: storage failures degrade to 0 unless strict). After
        :meth:`edit`, ``tokens`` are the edited sequence's and ``origin`` the edit's.
        """
        token_array = as_token_array(self._flat_tokens(tokens))
        layers = self._cache_layers(cache)
        cached = min(len(token_array), cache.get_seq_length())
        block = self.namespace.block_tokens
        usable = cached // block * block
        if usable == 0:
            return 0
        # Copy (and move off the device) only the tokens after the already cached prefix: a
        # long conversation's next turn then costs its new tokens, not the whole prefix.
        start = self.namespace.cached_length(token_array[:usable], origin=origin)
        if start == usable:
            return 0
        rows = [self._layer_from_cache(keys, values, start, usable) for keys, values in layers]
        return self.namespace.store(
            token_array[:usable], rows, kind=kind, start=start, origin=origin
        )

    def _cache_layers(self, cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not isinstance(cache, Cache):
            raise InvalidRequestError(
                f"cache must be a transformers Cache, got {type(cache).__name__}"
            )
        layers = list(getattr(cache, "layers", []))
        if len(layers) != self.layout.num_layers:
            raise InvalidRequestError(
                f"the cache has {len(layers)} layers, the model {self.layout.num_layers}"
            )
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index, layer in enumerate(layers):
            keys = getattr(layer, "keys", None)
            values = getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                raise InvalidRequestError(f"layer {index} of the cache holds no keys and values")
            if keys.dim() != 4 or keys.shape[0] != 1:
                raise InvalidRequestError(
                    f"layer {index}: only batch size 1 is supported, keys have shape "
                    f"{list(keys.shape)}"
                )
            pairs.append((keys, values))
        return pairs

    def _layer_from_cache(
        self, keys: torch.Tensor, values: torch.Tensor, start: int, stop: int
    ) -> Layer:
        """One layer of tokens ``start .. stop - 1``, shaped as :meth:`Namespace.store` takes it."""
        return _FROM_HF_CACHE[self.layout.kind](keys, values, start, stop)

    # ---- restore ------------------------------------------------------------------------------

    def lookup(self, tokens: Any, *, origin: EditedPrefix | None = None) -> int:
        """How many leading tokens of ``tokens`` :meth:`restore` would restore now."""
        token_array = as_token_array(self._flat_tokens(tokens))
        return self.namespace.lookup(
            token_array[: self._restorable(len(token_array))], origin=origin
        )

    def _restorable(self, num_tokens: int) -> int:
        """The longest restorable prefix: whole blocks, leaving at least one token to compute
        (the model must run the last prompt token to produce the next token's logits)."""
        block = self.namespace.block_tokens
        return max(num_tokens - 1, 0) // block * block

    def restore(
        self,
        tokens: Any,
        *,
        device: str | torch.device | None = None,
        streaming: bool = False,
        origin: EditedPrefix | None = None,
    ) -> RestoredPrefix:
        """Restore the longest cached prefix of ``tokens`` as a cache the model accepts.

        The prefix is loaded layer by layer from the encrypted store onto ``device`` (the
        model's device by default). At most ``len(tokens) - 1`` tokens are restored, rounded
        down to whole 64-token blocks. A miss, or a load that fails (the prefix was evicted
        meanwhile, or its bytes failed to open and were dropped), returns a miss so that the
        model computes the whole prompt; with ``strict=True`` load failures raise.

        With ``streaming=True`` this returns as soon as the load has started: each layer of
        the returned cache takes its prefix from the load when the model first uses it, so
        layer i computes while layers i+1, ... are still being read and decrypted (see
        :mod:`tenantkv.integrations.streamed_layer`). A failure after the start then surfaces
        as a ``LoadError`` from the forward pass, and the caller recomputes without the cache.

        With ``origin`` (from :meth:`edit`), ``tokens`` is an edited conversation and its
        edited prefix is restored; a miss is then returned with ``origin`` kept, so that the
        caller can still edit or save on that chain.
        """
        token_array = as_token_array(self._flat_tokens(tokens))
        length = self.namespace.lookup(
            token_array[: self._restorable(len(token_array))], origin=origin
        )
        if length == 0:
            return RestoredPrefix(None, 0, origin)
        target = torch.device(device) if device is not None else self.model.device
        try:
            stream = self.namespace.load(token_array[:length], device=target, origin=origin)
            if streaming:
                feed = LayerFeed(stream, self._cache_from_layer)
                cache = streamed_cache(self.model.config, feed, self.layout.num_layers)
                return RestoredPrefix(cache, length, origin)
            cache = DynamicCache(config=self.model.config)
            with stream:
                for index, layer in stream:
                    keys, values = self._cache_from_layer(layer)
                    cache.update(keys, values, index)  # copies out of the loader's buffer
        except (CacheMissError, LoadError) as err:
            if self._strict:
                raise
            logger.warning("restore of a %d-token prefix degraded to a miss: %s", length, err)
            return RestoredPrefix(None, 0, origin)
        return RestoredPrefix(cache, length, origin)

    # ---- edit ---------------------------------------------------------------------------------

    def edit(self, restored: RestoredPrefix, tokens: Any, script: EditScript) -> EditedRestore:
        """Apply ``script`` (spans of ``tokens``) to a restored prefix of ``tokens``.

        The restored cache loses the dropped tokens it holds and its retained keys move to
        contiguous positions; dropped tokens after it are simply left out of the returned
        token sequence. The restored cache is not changed. The result's ``origin`` addresses
        the edited prefix (the restored prefix's own when nothing cached was dropped).
        """
        if not isinstance(restored, RestoredPrefix):
            raise InvalidRequestError("edit takes what restore() returned")
        if not isinstance(script, EditScript):
            raise InvalidRequestError(f"script must be an EditScript, got {type(script).__name__}")
        if restored.cache is not None and restored.cache.get_seq_length() != restored.num_tokens:
            raise InvalidRequestError(
                "the restored cache has been run since it was restored; edit it before the model "
                "uses it"
            )
        flat = self._flat_tokens(tokens)
        token_tensor = flat if isinstance(flat, torch.Tensor) else torch.tensor(flat)
        token_array = as_token_array(token_tensor)
        if restored.num_tokens > len(token_array):
            raise InvalidRequestError("the restored prefix is longer than the tokens")
        edited_tokens = script.apply_to_tokens(token_tensor)[None]
        if restored.cache is None or restored.num_tokens == 0:
            return EditedRestore(None, 0, edited_tokens, restored.origin)
        length = restored.num_tokens
        origin = self.namespace.edited(token_array[:length], script, origin=restored.origin)
        cache = self.edit_cache(restored.cache, script)
        kept = length - script.dropped_tokens(length)
        return EditedRestore(cache, kept, edited_tokens, origin)

    def edit_cache(self, cache: Cache, script: EditScript) -> DynamicCache:
        """A new cache: ``cache`` (all ``cache.get_seq_length()`` tokens) after ``script``.

        The in-memory edit, as :meth:`edit` applies it to a restored cache (spans beyond the
        cache's tokens are ignored).
        """
        length = cache.get_seq_length()
        rope = self.rope
        edited = DynamicCache(config=self.model.config)
        for index, (keys, values) in enumerate(self._cache_layers(cache)):
            layer = _FROM_HF_CACHE[self.layout.kind](keys, values, 0, length)
            moved = edit_layer(self.layout, layer, length, script, rope)
            new_keys, new_values = _TO_HF_CACHE[self.layout.kind](self.layout, moved)
            edited.update(new_keys, new_values, index)
        return edited

    def _cache_from_layer(self, layer: Layer) -> tuple[torch.Tensor, torch.Tensor]:
        """A loaded layer as the model's cache update takes it (views; no copy here)."""
        return _TO_HF_CACHE[self.layout.kind](self.layout, layer)

    @staticmethod
    def _flat_tokens(tokens: Any) -> Any:
        """``[1, T]`` tensors (``input_ids``, ``generate`` output) as 1-D; the rest unchanged."""
        if isinstance(tokens, torch.Tensor) and tokens.dim() == 2:
            if tokens.shape[0] != 1:
                raise InvalidRequestError(
                    f"only batch size 1 is supported, got tokens of shape {list(tokens.shape)}"
                )
            return tokens[0]
        return tokens


def _latent_from_hf(keys: torch.Tensor, values: torch.Tensor, start: int, stop: int) -> Layer:
    # keys [1, 1, T, kv_lora_rank] (c_KV), values [1, 1, T, rope_dim] (k_rot)
    return torch.cat((keys[0, 0, start:stop], values[0, 0, start:stop]), dim=-1)


def _key_value_from_hf(keys: torch.Tensor, values: torch.Tensor, start: int, stop: int) -> Layer:
    # keys / values [1, H, T, D] -> [T, H, D]
    return keys[0, :, start:stop].transpose(0, 1), values[0, :, start:stop].transpose(0, 1)


#: How a transformers DynamicCache layer becomes a layer of each layout kind.
_FROM_HF_CACHE: dict[str, Callable[[torch.Tensor, torch.Tensor, int, int], Layer]] = {
    "mla": _latent_from_hf,
    "mha": _key_value_from_hf,
}


def _latent_to_hf(layout: KVLayout, layer: Layer) -> tuple[torch.Tensor, torch.Tensor]:
    assert isinstance(layer, torch.Tensor), "an MLA layer is one tensor"
    rank = layout.kv_lora_rank  # [T, kv_lora_rank + rope_dim] -> c_KV, k_rot
    return layer[None, None, :, :rank], layer[None, None, :, rank:]


def _key_value_to_hf(layout: KVLayout, layer: Layer) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = layer  # [T, H, D] each
    return keys.transpose(0, 1)[None], values.transpose(0, 1)[None]


#: How a loaded layer of each layout kind becomes a transformers cache update.
_TO_HF_CACHE: dict[str, Callable[[KVLayout, Layer], tuple[torch.Tensor, torch.Tensor]]] = {
    "mla": _latent_to_hf,
    "mha": _key_value_to_hf,
}
