"""The identity rule of the engine integrations: whose cache a request may use.

Shared by the vLLM connector and the SGLang backend, and free of both engines so it is tested in
the main suite. The rule:

* The tenant (and scope) come only from a signed assertion the gateway passed beside the request
  (:mod:`tenantkv.tenant_assertion`), verified with the gateway keys configured on the node.
* A client-chosen value (vLLM's ``cache_salt``, SGLang's extra keys) never selects a tenant:
  it is not read here at all.
* The assertion is bound to the tenant that holds its name now: one issued to a tenant since
  deleted (and perhaps created again under the same name) is refused (``stale_incarnation``),
  and an owner carries the incarnation it was checked against, so a namespace opened later for
  it (the worker side of vLLM, after the scheduler side's check) is that incarnation's or none.
* A missing, malformed, forged, expired or otherwise refused assertion gives *no* cache for the
  request (it is computed as without a cache) plus a ``tenant_assertion_refused`` security event:
  counted at once, logged at most once a minute, and audited on the system chain as one record
  per time window with the window's count by reason (``components/incidents.py``), written by a
  thread of the cache's own: a flood of refused requests costs the engine's thread no index
  write. The claimed tenant is not believed, so the event does not go to its chain.
* A tenantkv error on an engine's path (a token id out of range, an index outage, a closed
  cache) is a miss for that request plus a counted ``engine_errors`` health event
  (:class:`EngineErrors`), never an exception into the engine's step.
* Block keys are always tenantkv's keyed hashes under the namespace of the verified (tenant,
  scope, model, layout, block size); the engine's own block hashes are never used as keys.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy.exc import SQLAlchemyError

from ..api import TenantKV
from ..errors import InvalidRequestError, TenantAssertionError, TenantKVError, TenantNotFoundError
from ..layout import KVLayout
from ..security_events import LogLimiter
from ..services.namespace import Namespace
from ..services.tenants import TenantIncarnation, incarnation_hex
from ..tenant_assertion import ASSERTION_PARAM as ASSERTION_PARAM  # named here for engines
from ..tenant_assertion import AssertionVerifier, TenantAssertion

logger = logging.getLogger("tenantkv")

#: The security event kind of a refused assertion.
ASSERTION_REFUSED: Final = "tenant_assertion_refused"
#: The health counter of engine calls that an error of the cache turned into a miss.
ENGINE_ERRORS: Final = "engine_errors"
#: What an engine's path catches and turns into a miss: the cache's own errors, and index
#: failures a service let through. Anything else is a bug, and is not hidden.
ENGINE_FAILURES: Final = (TenantKVError, SQLAlchemyError)


class EngineErrors:
    """Errors that made an engine's call a miss: counted (the ``engine_errors`` health event,
    ``tenantkv_health_events_total{kind="engine_errors"}``) and logged at most once a minute
    per operation, so a stream of bad requests floods neither the log nor the engine."""

    def __init__(self, kv: TenantKV) -> None:
        self._kv = kv
        self._log_limit = LogLimiter()

    def failed(self, operation: str, err: BaseException, *, request_id: str = "") -> None:
        """Count and log an error that made ``operation`` a miss. The engine computes the
        request as without a cache; its step never sees the error."""
        self._kv.context.health.count(ENGINE_ERRORS)
        left_out = self._log_limit.allow(operation)
        if left_out is None:
            return
        logger.warning(
            "tenantkv %s failed for request %r, a miss: %s: %s%s",
            operation,
            request_id[:128],
            type(err).__name__,
            err,
            f" ({left_out} more not logged)" if left_out else "",
        )


@dataclass(frozen=True)
class RequestTenant:
    """The verified owner of a request's cache: the tenant (and scope), and the incarnation of
    the tenant its assertion was checked against. Every owner made from an assertion carries
    one; None (no binding: whichever tenant holds the name) is for trusted callers only."""

    tenant: str
    scope: str | None
    incarnation: str | None = None


class EngineNamespaces:
    """Verifies requests' assertions and opens the namespace of each verified owner.

    One per engine-side object (connector role, storage backend); namespaces are kept per owner,
    so a request's lookup costs no namespace query after the first one of its tenant.
    """

    def __init__(
        self,
        kv: TenantKV,
        verifier: AssertionVerifier,
        *,
        model: str,
        layout: KVLayout,
        block_tokens: int,
        revision: str | None = None,
    ) -> None:
        self.kv = kv
        self._verifier = verifier
        self._model = model
        self._revision = revision
        self.layout = layout
        self.block_tokens = block_tokens
        self._namespaces: dict[RequestTenant, Namespace] = {}
        self._incarnations: dict[str, TenantIncarnation] = {}
        self._revocations = kv.context.keys.revocations
        self._lock = threading.Lock()
        #: Counts and logs errors that made a call a miss (``failed(operation, err)``).
        self.errors = EngineErrors(kv)
        self.failed = self.errors.failed

    def identify(
        self, params: Mapping[str, Any] | None, *, request_id: str = ""
    ) -> RequestTenant | None:
        """The owner that the request's assertion names, or None (then: no cache, and a
        security event, unless the tenant does not exist). Nothing else in ``params`` and nothing
        the client chose is read."""
        raw = params.get(ASSERTION_PARAM) if isinstance(params, Mapping) else None
        try:
            owner = self.owner_of(self._verifier.verify(raw))
        except TenantAssertionError as err:
            # counted now, audited per window off this thread (the engine's scheduler)
            self.kv.context.incidents.refused(
                ASSERTION_REFUSED, err.reason, f"request {request_id[:128]!r}: {err}"
            )
            return None
        return owner

    def owner_of(self, claims: TenantAssertion) -> RequestTenant | None:
        """The owner a verified assertion names, bound to the incarnation of its tenant now;
        None when no tenant has that name. Raises TenantAssertionError
        (``stale_incarnation``) for an assertion issued to an earlier tenant of the name.

        Incarnations are kept, like namespaces, until the keyring forgets keys (as a deletion
        anywhere makes it); one that refuses an assertion is read again first, so a tenant
        re-created on another node is not refused for this node's stale memory of it."""
        current = self._current_incarnation(claims.tenant, fresh=False)
        if current is None:
            return None
        try:
            self._verifier.check_incarnation(
                claims, incarnation=current.incarnation, created_at=current.created_at
            )
        except TenantAssertionError:
            current = self._current_incarnation(claims.tenant, fresh=True)
            if current is None:
                return None
            self._verifier.check_incarnation(
                claims, incarnation=current.incarnation, created_at=current.created_at
            )
        return RequestTenant(claims.tenant, claims.scope, current.incarnation)

    def _current_incarnation(self, tenant: str, *, fresh: bool) -> TenantIncarnation | None:
        with self._lock:
            self._drop_if_revoked()
            cached = None if fresh else self._incarnations.get(tenant)
        if cached is not None:
            return cached
        current = self.kv.tenant_incarnation(tenant)
        with self._lock:
            if current is None:
                self._incarnations.pop(tenant, None)
            else:
                self._incarnations[tenant] = current
        return current

    def _drop_if_revoked(self) -> None:
        """Forget namespaces and incarnations once the keyring forgot keys (under the lock)."""
        revocations = self.kv.context.keys.revocations
        if revocations != self._revocations:
            self._namespaces.clear()
            self._incarnations.clear()
            self._revocations = revocations

    def namespace(self, owner: RequestTenant) -> Namespace | None:
        """The owner's namespace for this engine's model and layout; None when the tenant does
        not exist in this cache (a miss: the gateway vouched for it, the operator has not
        created it, or deleted it).

        Namespaces (which hold their clear hashing key) are kept until the keyring forgets keys
        (a tenant deleted, keys retired, here or on another node): then all are dropped, so a
        deleted tenant's key does not outlive its shredding here, and a tenant created again
        under the same name gets its own namespace. An owner bound to an incarnation gets
        that incarnation's namespace or None, never the namespace of a later tenant of the
        name."""
        with self._lock:
            self._drop_if_revoked()
            cached = self._namespaces.get(owner)
        if cached is not None:
            return cached
        try:
            namespace = self.kv.namespace(
                owner.tenant,
                model=self._model,
                revision=self._revision,
                layout=self.layout,
                scope=owner.scope,
                block_tokens=self.block_tokens,
            )
        except (TenantNotFoundError, InvalidRequestError) as err:
            logger.info("no cache for tenant %r: %s", owner.tenant, err)
            return None
        except ENGINE_FAILURES as err:  # the index failed, the cache closed: a miss
            self.failed("namespace", err)
            return None
        if owner.incarnation is not None and owner.incarnation != incarnation_hex(
            namespace.identity.tenant_id
        ):
            logger.info("no cache for tenant %r: it was deleted since its check", owner.tenant)
            return None
        with self._lock:
            return self._namespaces.setdefault(owner, namespace)

    def resolve(
        self, params: Mapping[str, Any] | None, *, request_id: str = ""
    ) -> tuple[RequestTenant, Namespace] | None:
        """:meth:`identify` then :meth:`namespace`: the request's cache, or None."""
        owner = self.identify(params, request_id=request_id)
        if owner is None:
            return None
        namespace = self.namespace(owner)
        return None if namespace is None else (owner, namespace)
