"""Editing a cached prefix where it is stored: load it, drop and repos, seal the result.

For callers that hold no copy of the prefix (a scheduler preparing an agent's next turn, an
operator tool): the parent is loaded through the ordinary load path (leases, integrity checks,
metering of served tokens), edited by :mod:`tenantkv.editing.apply`, and stored through the
ordinary store path (quota, eviction, sealing, metering of stored tokens) on the edited
prefix's own key chain, so it is isolated, metered and audited like any other store.

Only what changed is written: the blocks before the first one the edit touches keep the
parent's keys, so they are the parent's stored segments and the store skips them. Every later
block is sealed anew, since a segment's associated data binds its block key and an edit changes
the keys (and which tokens share a block); its unmoved values keep their plaintext bytes
(``c_KV``, V). The edited prefix's last partial block is not stored (only full blocks are), as
for any prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..editing.apply import edit_layer
from ..editing.lineage import EditedPrefix
from ..editing.rope import RopeSpec
from ..editing.script import EditScript
from ..errors import CacheMissError, InvalidRequestError
from ..layout import Layer
from ..retention import DEFAULT_KIND
from ..tokens import TokenArray, as_token_array
from .namespace import Namespace


@dataclass(frozen=True)
class EditedStore:
    """The outcome of :func:`edit_cached_prefix`."""

    #: Pass as ``origin=`` with :attr:`tokens` (and later tokens after them).
    origin: EditedPrefix | None
    #: The edited prefix's tokens (the parent's retained tokens).
    tokens: TokenArray
    #: Tokens newly stored (whole blocks of :attr:`tokens`; 0 if they were stored already).
    stored_tokens: int


def edit_cached_prefix(
    namespace: Namespace,
    tokens: Any,
    script: EditScript,
    rope: RopeSpec,
    *,
    origin: EditedPrefix | None = None,
    kind: str = DEFAULT_KIND,
) -> EditedStore:
    """Apply ``script`` to the cached prefix ``tokens`` (whole blocks, all cached; the edited
    prefix ``origin`` when given) and store the result on the edited prefix's chain.

    Holds the whole prefix in host memory while it edits it (one copy, plus the edited one).
    Raises :class:`CacheMissError` when ``tokens`` is not all cached.
    """
    token_array = as_token_array(tokens)
    new_origin = namespace.edited(token_array, script, origin=origin)
    edited_tokens = token_array[script.kept_positions(len(token_array)).numpy()]
    if new_origin is origin:
        return EditedStore(origin, edited_tokens, 0)
    if namespace.cached_length(token_array, origin=origin) != len(token_array):
        raise CacheMissError("only a wholly cached prefix can be edited in the store")
    layers: list[Layer] = []
    with namespace.load(token_array, origin=origin) as stream:
        for index, layer in stream:
            if index != len(layers):
                raise InvalidRequestError("the load delivered layers out of order")
            layers.append(edit_layer(namespace.layout, layer, len(token_array), script, rope))
    stored = namespace.store(edited_tokens, layers, kind=kind, origin=new_origin)
    return EditedStore(new_origin, edited_tokens, stored)
