"""A namespace's identity and keys: what its reads and its writes share.

Nothing is shared across namespaces: each has its own hashing key, so identical tokens give
unrelated block keys (``tenantkv.prefix``). Edited prefixes are keyed on a chain of their own
that starts from the parent's keys (:meth:`NamespaceKeys.edited`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..components.context import CacheContext
from ..editing.lineage import EditedPrefix
from ..editing.script import EditScript
from ..errors import InvalidRequestError
from ..index import removals
from ..layout import KVLayout
from ..prefix import (
    BLOCK_TOKENS,
    BlockKey,
    EditSeed,
    Fingerprint,
    block_keys,
    edit_binding,
    edit_seed,
)
from ..tokens import as_token_array


@dataclass(frozen=True)
class NamespaceIdentity:
    namespace_id: bytes
    tenant_id: bytes
    tenant: str
    scope: str | None
    model: str
    fingerprint: Fingerprint
    #: Tokens per block: every key, lookup length and load of the namespace is in these blocks.
    block_tokens: int = BLOCK_TOKENS


class NamespaceKeys:
    """One namespace's identity and the block keys of its prefixes (and of edited ones).

    The base of :class:`~tenantkv.services.namespace.Namespace` that its reads (``reads.py``)
    and writes (``writes.py``) share: both start from the same keys and meter the same tenant.
    """

    def __init__(
        self, ctx: CacheContext, identity: NamespaceIdentity, layout: KVLayout, hash_key: bytes
    ) -> None:
        self._ctx = ctx
        self.identity = identity
        self.layout = layout
        self._hash_key = hash_key
        self._removals = removals.counter_name(identity.namespace_id)

    @property
    def tenant(self) -> str:
        return self.identity.tenant

    @property
    def block_tokens(self) -> int:
        """Tokens per block in this namespace (64 unless it was opened with another size)."""
        return self.identity.block_tokens

    @property
    def scope(self) -> str | None:
        return self.identity.scope

    @property
    def model(self) -> str:
        return self.identity.model

    # ---- keys ---------------------------------------------------------------------------------

    def _keys(self, tokens: Any, origin: EditedPrefix | None = None) -> list[BlockKey]:
        """Block keys of ``tokens``: an unedited prefix's, or those of the edited prefix
        ``origin`` (see :meth:`edited` and ``tenantkv.prefix``): the parent's keys for the
        blocks the edit did not touch, then the edited chain."""
        token_array = (
            tokens  # already what as_token_array makes (lookup and store pass theirs)
            if isinstance(tokens, np.ndarray)
            and tokens.dtype == np.uint32
            and tokens.ndim == 1
            and tokens.flags.c_contiguous
            else as_token_array(tokens)
        )
        fingerprint = self.identity.fingerprint
        if origin is None:
            return block_keys(self._hash_key, fingerprint, token_array, self.block_tokens)
        self._check_origin(origin)
        shared = origin.shared_blocks * self.block_tokens
        head = self._keys(token_array[:shared], origin.parent)
        if len(token_array) <= shared:
            return head
        previous: bytes = head[-1] if head else fingerprint
        seed: Fingerprint | EditSeed = edit_seed(self._hash_key, previous, origin.binding)
        return head + block_keys(self._hash_key, seed, token_array[shared:], self.block_tokens)

    def _check_origin(self, origin: Any) -> None:
        if not isinstance(origin, EditedPrefix):
            raise InvalidRequestError(
                f"origin must be an EditedPrefix, got {type(origin).__name__}"
            )
        if origin.namespace_id != self.identity.namespace_id:
            raise InvalidRequestError("this edited prefix belongs to another namespace")

    def edited(
        self, parent_tokens: Any, script: EditScript, *, origin: EditedPrefix | None = None
    ) -> EditedPrefix | None:
        """Where the prefix made by ``script`` from the cached prefix ``parent_tokens`` (whole
        blocks; itself the edited prefix ``origin`` when given) lives.

        The result is passed as ``origin=`` to :meth:`lookup`, :meth:`store` and :meth:`load`
        together with the edited token sequence (the retained tokens, then any later ones).
        When ``script`` drops nothing from ``parent_tokens`` the parent's cache is unchanged and
        its own ``origin`` (None for an unedited prefix) is returned: the edited sequence is then
        an ordinary extension of the parent. Pure key derivation: nothing is read or written.
        """
        if not isinstance(script, EditScript):
            raise InvalidRequestError(f"script must be an EditScript, got {type(script).__name__}")
        token_array = as_token_array(parent_tokens)
        if len(token_array) == 0 or len(token_array) % self.block_tokens:
            raise InvalidRequestError(
                f"an edit applies to a cached prefix of whole {self.block_tokens}-token blocks, "
                f"got {len(token_array)} tokens"
            )
        cut = script.within(len(token_array))
        if cut.is_empty:
            return origin
        parent_key = self._keys(token_array, origin)[-1]
        return EditedPrefix(
            self.identity.namespace_id,
            edit_binding(self._hash_key, parent_key, cut.canonical_bytes()),
            origin,
            shared_blocks=cut.drops[0][0] // self.block_tokens,
            depth=1 if origin is None else origin.depth + 1,
            dropped_tokens=cut.dropped_tokens() + (0 if origin is None else origin.dropped_tokens),
        )

    def _meter(self, **counts: int) -> None:
        self._ctx.meter.add(self.identity.tenant_id, self.scope or "", self._ctx.clock(), **counts)
