"""Moving RoPE-rotated keys to new positions: an exact rotation, no recomputation.

RoPE rotates each pair of a key's rotary dimensions by ``position * f_i`` (``f_i`` the pair's
inverse frequency), so a key cached at position ``p`` moves to ``p + delta`` by one more rotation
of ``delta * f_i``::

    k' = k * cos(delta * theta) + rotate_half(k) * sin(delta * theta)

which is what repositioning retained tokens after a drop needs. Only the rotary part moves: an
MLA latent ``c_KV`` and MHA values carry no position (:mod:`tenantkv.layout_kinds` says which
part of a layer is the rotated key).

Precision. Angles and their cosines and sines are computed in float64 (``delta * f_i`` for
``delta`` in the thousands loses digits in float32), the rotation in float32, and the result is
rounded to the cache's dtype once. Tokens whose ``delta`` is 0 are left as they are, byte for
byte. A model's own float32 angles ``fl32(p * f_i)`` already differ from ``p * f_i`` by up to
``p * f_i * 2**-24``; the shift adds no error of that kind.

Pair layouts. ``"half"``: dimension ``i`` pairs with ``i + R/2`` (Llama's ``rotate_half``; also
what transformers' DeepSeek-V3 caches, since its interleaved rotation writes its output
de-interleaved). ``"interleaved"``: ``2i`` pairs with ``2i + 1`` (DeepSeek's reference code and
engines that cache ``k_pe`` as complex pairs). Frequencies come from the model: the base, the
rotary dimensions and any static scaling (linear, YaRN, Llama 3) are all in ``inv_freq``; the
integration takes them from the model (``tenantkv.integrations.transformers.rope_for``).
Scalings whose frequencies depend on the sequence length (dynamic NTK, LongRoPE) cannot be
shifted exactly and are refused there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import InvalidRequestError

PairLayout = Literal["half", "interleaved"]
PAIR_LAYOUTS: tuple[PairLayout, ...] = ("half", "interleaved")


@dataclass(frozen=True)
class RopeSpec:
    """A model's rotary embedding as the cache holds it: one inverse frequency per rotated
    pair (``2 * len(inv_freq)`` rotary dimensions, the first of a key's dimensions; any others
    are not rotated) and the pair layout."""

    inv_freq: tuple[float, ...]
    pairs: PairLayout = "half"

    def __post_init__(self) -> None:
        if not self.inv_freq:
            raise InvalidRequestError("a RoPE spec needs at least one frequency")
        if self.pairs not in PAIR_LAYOUTS:
            raise InvalidRequestError(
                f"pairs must be one of {', '.join(PAIR_LAYOUTS)}, got {self.pairs!r}"
            )

    @classmethod
    def from_frequencies(
        cls, inv_freq: Sequence[float] | torch.Tensor, pairs: PairLayout = "half"
    ) -> RopeSpec:
        values = inv_freq.tolist() if isinstance(inv_freq, torch.Tensor) else list(inv_freq)
        return cls(tuple(float(value) for value in values), pairs)

    @classmethod
    def standard(cls, theta: float, rotary_dims: int, pairs: PairLayout = "half") -> RopeSpec:
        """Unscaled RoPE: ``f_i = theta ** (-2i / rotary_dims)``, computed as transformers
        does (float32), so the frequencies are the model's own."""
        if rotary_dims <= 0 or rotary_dims % 2:
            raise InvalidRequestError(f"rotary_dims must be even and positive, got {rotary_dims}")
        exponents = torch.arange(0, rotary_dims, 2, dtype=torch.float) / rotary_dims
        return cls.from_frequencies(1.0 / (theta**exponents), pairs)

    @property
    def rotary_dims(self) -> int:
        return 2 * len(self.inv_freq)


def rotate_to(keys: torch.Tensor, delta: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """``keys`` (``[T, ..., D]``, rotated at their positions) moved by ``delta[t]`` positions.

    Returns a new tensor of ``keys``' dtype and device; rows whose ``delta`` is 0 are copied
    unchanged.
    """
    if keys.dim() < 2 or delta.dim() != 1 or delta.shape[0] != keys.shape[0]:
        raise InvalidRequestError(
            f"keys [T, ..., D] and one delta per token expected, got {list(keys.shape)} and "
            f"{list(delta.shape)}"
        )
    dims = rope.rotary_dims
    if dims > keys.shape[-1]:
        raise InvalidRequestError(
            f"the RoPE spec rotates {dims} dimensions, the keys have {keys.shape[-1]}"
        )
    result = keys.clone()
    moving = torch.nonzero(delta.to("cpu")).flatten()
    if len(moving) == 0:
        return result
    moving = moving.to(keys.device)
    frequencies = torch.tensor(rope.inv_freq, dtype=torch.float64, device=keys.device)
    angles = delta.to(device=keys.device, dtype=torch.float64)[moving, None] * frequencies
    view = (len(moving),) + (1,) * (keys.dim() - 2) + (len(rope.inv_freq),)
    cos = angles.cos().to(torch.float32).view(view)
    sin = angles.sin().to(torch.float32).view(view)
    rotary = keys[moving, ..., :dims].to(torch.float32)
    if rope.pairs == "half":
        first, second = rotary[..., : dims // 2], rotary[..., dims // 2 :]
    else:
        first, second = rotary[..., 0::2], rotary[..., 1::2]
    moved = torch.empty_like(rotary)
    if rope.pairs == "half":
        moved[..., : dims // 2] = first * cos - second * sin
        moved[..., dims // 2 :] = second * cos + first * sin
    else:
        moved[..., 0::2] = first * cos - second * sin
        moved[..., 1::2] = second * cos + first * sin
    result[moving, ..., :dims] = moved.to(keys.dtype)  # the one rounding
    return result
