"""Applying an edit script to the layers of a cached prefix (drop, then repos).

Pure tensor work, the same in memory (``PrefixCache.edit``) and on a prefix loaded from the
store (:mod:`tenantkv.services.editing`), so both give the same bytes. The layout kind says which
part of a layer carries positions (MLA: ``k_pe``; MHA: K); only that part is rotated, by
:func:`tenantkv.editing.rope.rotate_to`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InvalidRequestError
from ..layout import KVLayout, Layer
from .rope import RopeSpec, rotate_to
from .script import EditScript


def edit_layer(
    layout: KVLayout, layer: Layer, num_tokens: int, script: EditScript, rope: RopeSpec
) -> Layer:
    """One layer of a ``num_tokens``-token prefix after ``script`` (a new layer; the input is
    not changed). Spans beyond ``num_tokens`` are ignored: those tokens are not cached."""
    kept, delta = script.shifts(num_tokens)
    return layout.strategy.reposition(
        layout, layer, kept, lambda keys: rotate_to(keys, delta, rope)
    )


def edit_layers(
    layout: KVLayout, layers: Sequence[Layer], num_tokens: int, script: EditScript, rope: RopeSpec
) -> list[Layer]:
    """Every layer of a prefix after ``script``."""
    if len(layers) != layout.num_layers:
        raise InvalidRequestError(f"got {len(layers)} layers, the layout has {layout.num_layers}")
    return [edit_layer(layout, layer, num_tokens, script, rope) for layer in layers]
