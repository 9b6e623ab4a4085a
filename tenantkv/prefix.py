"""Prefix keys: keyed, chained hashes of token blocks (pure functions, no I/O).

Blocks are 64 tokens unless a namespace chose another size (then ``64`` below reads as that).

::

    k_0 = H_ns(fingerprint || tokens[0:64])
    k_i = H_ns(k_{i-1}     || tokens[64*i : 64*i + 64])

``H_ns`` is BLAKE2b-256 keyed with the namespace's secret key, and tokens are hashed as
little-endian uint32. Chaining makes a block's key depend on every token before it, so a key
match is a prefix match; keying makes keys unpredictable to anyone without the namespace key, so a
tenant can neither plant a collision (vLLM CVE-2025-25183) nor link keys across namespaces, and the
index holds nothing from which tokens could be recovered. Only full blocks get keys. The chain
runs in C (``_prefix_chain.c``, one call for a whole prompt) where the install built it, and in
hashlib otherwise: the same keys.

Edited prefixes (``tenantkv.editing``: tokens dropped, the rest repositioned) share the parent's
blocks up to the first block an edit touches (``n`` blocks: same tokens, same positions, same
bytes), then chain from a seed of their own::

    binding = H_edit(parent_key || edit script)
    k_i     = parent chain's k_i                          for i < n
    k_n     = H_ns(H_chain(k_{n-1} || binding) || tokens[64n : 64n + 64])   (k_{-1}: fingerprint)
    k_i     = H_ns(k_{i-1} || tokens[64i : 64i + 64])   for i > n

``H_edit`` and ``H_chain`` are BLAKE2b keyed the same with other personalisations.
``parent_key`` is the key of the parent prefix's last block, so an edited prefix's keys depend on
every parent token and on the script, never collide with an unedited prefix's, and are as
unpredictable across namespaces. The seed of block ``n`` also hashes ``k_{n-1}`` as computed from
the caller's tokens, so a key match is still a prefix match: other tokens in the shared blocks
give other keys after them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any, NewType, cast

import numpy as np
from typing_extensions import Buffer

from .tokens import TokenArray

#: Tokens per block unless a namespace says otherwise (``TenantKV.namespace(block_tokens=)``).
BLOCK_TOKENS = 64
#: Block sizes a namespace may choose: multiples of 16 (engines page KV in 16/32/64-token
#: blocks), up to 1024.
BLOCK_TOKENS_STEP = 16
MAX_BLOCK_TOKENS = 1024
BLOCK_KEY_BYTES = 32

BlockKey = NewType("BlockKey", bytes)
"""Keyed prefix hash of one full block (32 bytes)."""

Fingerprint = NewType("Fingerprint", bytes)
"""SHA-256 of the model identity and KV layout of a namespace (32 bytes)."""

EditSeed = NewType("EditSeed", bytes)
"""Where an edited prefix's key chain starts (32 bytes; see the module docstring)."""

_PERSON = b"tenantkv-pfx-v1"  # BLAKE2b personalisation: domain separation from other uses
_EDIT_PERSON = b"tenantkv-edit-v1"
_CHAIN_PERSON = b"tenantkv-ech-v1"


def model_fingerprint(model: str, revision: str | None, layout: dict[str, Any]) -> Fingerprint:
    """Fingerprint of what produced a cache: model id, revision, layout, dtype and codec."""
    description = {
        "codec": "raw-v1",
        "layout": layout,
        "model": model,
        "revision": revision,
    }
    canonical = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return Fingerprint(hashlib.sha256(canonical.encode("utf-8")).digest())


def layout_identity(layout: dict[str, Any], block_tokens: int) -> dict[str, Any]:
    """What the fingerprint hashes of a namespace's layout: the layout's description, and the
    block size when it is not the default (so every namespace made before block sizes could be
    chosen keeps its fingerprint, and its cache)."""
    if block_tokens == BLOCK_TOKENS:
        return layout
    return {**layout, "block_tokens": block_tokens}


def full_blocks(num_tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """How many full blocks of ``block_tokens`` tokens ``num_tokens`` tokens make."""
    return num_tokens // block_tokens


ChainFunction = Callable[[Buffer, Buffer, Buffer, Buffer, int], list[bytes]]
"""``block_keys(key, person, seed, data, block_bytes)`` of ``tenantkv/_prefix_chain.c``."""


def _built_chain() -> ChainFunction | None:
    """The C chain, where the install built it (setup.py: wherever a C compiler is at hand)."""
    try:
        from ._prefix_chain import block_keys as chain
    except ImportError:  # pragma: no cover - only an install without a C compiler
        return None
    return chain


c_chain = _built_chain()


def block_keys(
    namespace_key: bytes,
    fingerprint: Fingerprint | EditSeed,
    tokens: TokenArray,
    block_tokens: int = BLOCK_TOKENS,
) -> list[BlockKey]:
    """The chained keys of every full block of ``tokens``, chained from the namespace's
    ``fingerprint`` (or from an edited prefix's seed).

    Computed in one call of the C chain (``tenantkv/_prefix_chain.c``, 0.6x the time of the
    loop below on a 128K-token prompt) where the install built it, else by
    :func:`block_keys_python`: the same keys either way."""
    if c_chain is None:
        return block_keys_python(namespace_key, fingerprint, tokens, block_tokens)
    data = np.ascontiguousarray(tokens, dtype="<u4").data  # the tokens' own memory: no copy
    keys = c_chain(namespace_key, _PERSON, fingerprint, data, block_tokens * 4)
    return cast(list[BlockKey], keys)


def block_keys_python(
    namespace_key: bytes,
    fingerprint: Fingerprint | EditSeed,
    tokens: TokenArray,
    block_tokens: int = BLOCK_TOKENS,
) -> list[BlockKey]:
    """:func:`block_keys` through hashlib: the reference the C chain is tested against, and
    what runs where it was not built (an install without a C compiler)."""
    data = tokens.astype("<u4", copy=False).tobytes()
    step = block_tokens * 4
    keys: list[bytes] = []
    append = keys.append
    previous: bytes = fingerprint
    # The key block is the first compression of every keyed BLAKE2b: do it once and copy the
    # state per block (the same digests, ~25% less time per key on a long prompt). The loop
    # is what a 128K-token lookup spends most of its time in (docs/perf.md, "Lookup").
    keyed = hashlib.blake2b(key=namespace_key, digest_size=BLOCK_KEY_BYTES, person=_PERSON).copy
    for start in range(0, full_blocks(len(tokens), block_tokens) * step, step):
        digest = keyed()
        digest.update(previous)
        digest.update(data[start : start + step])
        previous = digest.digest()
        append(previous)
    return cast(list[BlockKey], keys)  # BlockKey is bytes: no per-key wrapping call


def edit_binding(namespace_key: bytes, parent_key: BlockKey, script: bytes) -> bytes:
    """What identifies the edit ``script`` (its canonical bytes) of the prefix whose last block
    key is ``parent_key`` (32 bytes, keyed)."""
    digest = hashlib.blake2b(
        parent_key, key=namespace_key, digest_size=BLOCK_KEY_BYTES, person=_EDIT_PERSON
    )
    digest.update(script)
    return digest.digest()


def edit_seed(namespace_key: bytes, previous: bytes, binding: bytes) -> EditSeed:
    """Where an edited prefix's own chain starts: after the shared block whose key is
    ``previous`` (the fingerprint when no block is shared), for the edit ``binding``."""
    digest = hashlib.blake2b(
        previous, key=namespace_key, digest_size=BLOCK_KEY_BYTES, person=_CHAIN_PERSON
    )
    digest.update(binding)
    return EditSeed(digest.digest())
