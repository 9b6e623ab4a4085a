"""The identity step every gateway takes, as one function: strip what the client sent, then set
what the verified identity selects.

``tenantkv gateway`` (:mod:`.app`) and the LiteLLM hook (:mod:`tenantkv.integrations.litellm`)
both call it, so the rule cannot drift between them: every identity-bearing field goes first, at
any depth (:mod:`.scrub`), then ``cache_salt`` is the keyed hash of the identity (:mod:`.keyed`)
and ``kv_transfer_params`` holds only the signed assertion, which is what the vLLM connector
reads. The order matters: set before stripping, the gateway's own fields would be removed; set
without stripping, a client's nested copy would ride along.
"""

from __future__ import annotations

from typing import Any

from ..tenant_assertion import ASSERTION_PARAM, AssertionSigner
from .identity import IdentityLike
from .keyed import cache_salt
from .scrub import scrub
from .settings import GatewaySettings


def stamp(
    body: dict[str, Any],
    identity: IdentityLike,
    *,
    signer: AssertionSigner,
    secret: bytes,
    settings: GatewaySettings,
) -> int:
    """Rewrite ``body`` in place for ``identity``: stripped, salted, given the assertion
    (for ``settings.audience``, valid ``settings.assertion_lifetime`` seconds). Returns how many
    client fields were removed.

    Raises :class:`~tenantkv.errors.InvalidRequestError` when the identity cannot be signed
    (a tenant or scope that is no valid label); the body is then stripped but not stamped."""
    removed = scrub(body)
    assertion = signer.sign(
        identity.tenant,
        scope=identity.scope,
        audience=settings.audience,
        ttl=settings.assertion_lifetime,
        incarnation=identity.incarnation,
    )
    body["cache_salt"] = cache_salt(secret, identity)
    body["kv_transfer_params"] = {ASSERTION_PARAM: assertion}
    return removed
