"""Prefix keys: keyed, chained hashes of 64-token blocks (pure functions, no I/O).

::

    k_0 = H_ns(fingerprint || tokens[0:64])
    k_i = H_ns(k_{i-1}     || tokens[64*i : 64*i + 64])

``H_ns`` is BLAKE2b-256 keyed with the namespace's secret key, and tokens are hashed as
little-endian uint32. Chaining makes a block's key depend on every token before it, so a key
match is a prefix match; keying makes keys unpredictable to anyone without the namespace key, so a
tenant can neither plant a collision (vLLM CVE-2025-25183) nor link keys across namespaces, and the
index holds nothing from which tokens could be recovered. Only full blocks get keys.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NewType

from .tokens import TokenArray

BLOCK_TOKENS = 64
BLOCK_KEY_BYTES = 32

BlockKey = NewType("BlockKey", bytes)
"""Keyed prefix hash of one full block (32 bytes)."""

Fingerprint = NewType("Fingerprint", bytes)
"""SHA-256 of the model identity and KV layout of a namespace (32 bytes)."""

_PERSON = b"tenantkv-pfx-v1"  # BLAKE2b personalisation: domain separation from other uses


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


def full_blocks(num_tokens: int) -> int:
    """How many full 64-token blocks ``num_tokens`` tokens make."""
    return num_tokens // BLOCK_TOKENS


def block_keys(
    namespace_key: bytes, fingerprint: Fingerprint, tokens: TokenArray
) -> list[BlockKey]:
    """The chained keys of every full block of ``tokens``."""
    data = tokens.astype("<u4", copy=False).tobytes()
    step = BLOCK_TOKENS * 4
    keys: list[BlockKey] = []
    previous: bytes = fingerprint
    for start in range(0, full_blocks(len(tokens)) * step, step):
        digest = hashlib.blake2b(
            previous, key=namespace_key, digest_size=BLOCK_KEY_BYTES, person=_PERSON
        )
        digest.update(data[start : start + step])
        previous = digest.digest()
        keys.append(BlockKey(previous))
    return keys
