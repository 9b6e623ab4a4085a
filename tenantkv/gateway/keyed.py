"""The gateway's keyed values: the cache salt and the affinity digest.

Both are HMAC-SHA256 under the gateway secret, with a label per use so neither can stand for
the other:

* the ``cache_salt`` of a request is a hash of the verified (tenant, scope, incarnation) only,
  so vLLM's own prefix cache is partitioned by identity: two identities never share a salt, one
  identity always gets the same, and a client that learns a salt cannot compute another's;
* the affinity digest covers the identity, the model and the beginning of the prompt (its first
  characters, or first messages), so a tenant's repeated prefix ranks the same backend first,
  while the digest tells the router nothing that could be matched across tenants.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Final

from .identity import IdentityLike

_SALT_LABEL: Final = b"tenantkv-gateway-cache-salt-v1"
_AFFINITY_LABEL: Final = b"tenantkv-gateway-affinity-v1"


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _identity(identity: IdentityLike) -> list[str | None]:
    return [identity.tenant, identity.scope, identity.incarnation]


def cache_salt(secret: bytes, identity: IdentityLike) -> str:
    """The ``cache_salt`` set on every request of this identity (hex)."""
    message = _SALT_LABEL + b"\0" + _canonical(_identity(identity))
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def first_block(body: dict[str, Any], *, chars: int, messages: int) -> str:
    """The beginning of a request's prompt: the first ``chars`` characters of the completion
    prompt, or of the canonical JSON of the first ``messages`` chat messages. A prompt of token
    ids reads as its JSON too."""
    if "messages" in body:
        raw = body["messages"]
        head: Any = raw[:messages] if isinstance(raw, list) else raw
    else:
        head = body.get("prompt")
        if isinstance(head, list) and head and isinstance(head[0], str | list):
            head = head[0]  # a batch: its first prompt
    text = head if isinstance(head, str) else _canonical(head).decode("ascii")
    return text[:chars]


def affinity_digest(
    secret: bytes, identity: IdentityLike, body: dict[str, Any], *, chars: int, messages: int
) -> bytes:
    """The keyed digest of (identity, model, the prompt's first block) that routing ranks by."""
    model = body.get("model")
    message = (
        _AFFINITY_LABEL
        + b"\0"
        + _canonical(
            [
                _identity(identity),
                model if isinstance(model, str) else None,
                first_block(body, chars=chars, messages=messages),
            ]
        )
    )
    return hmac.new(secret, message, hashlib.sha256).digest()
