"""Error families of tenantkv. Each failure family has one type; callers catch the family.

* :class:`InvalidRequestError` -- the caller's input is wrong (tokens, layers, names, arguments).
  Nothing was changed.
* :class:`TenantExistsError`, :class:`TenantNotFoundError` -- tenant lifecycle.
* :class:`CacheMissError` -- a load asked for a prefix that is not (or no longer) cached.
* :class:`LoadError` -- a load failed after it started; it says how many layers were delivered.
  :class:`SegmentIntegrityError` is the case where stored bytes failed to open (tampering or
  corruption): the extent has been dropped and a security event recorded;
  :class:`LoadRevokedError` the case where the tenant was deleted (or the key version retired)
  while the load ran.
* :class:`CacheUnavailableError` -- the index or block store failed (strict mode only; otherwise the
  serving path degrades to a miss; maintenance calls raise it, and so does ``open()`` when the
  index server cannot be reached in time). Every public method of ``TenantKV``, ``Namespace``,
  ``kv.tokens`` and ``kv.audit`` raises it rather than a driver's or block store's error
  (``tenantkv.index.failures``), on PostgreSQL within ``index_serving_timeout`` (serving calls)
  or ``index_admin_timeout`` (the rest; ``tenantkv.index.bounds``).
* :class:`TenantAssertionError` -- a serving engine's request carried no valid signed tenant
  assertion (missing, malformed, forged, expired, ...; ``reason`` says which). Engines turn it
  into a miss plus a security event, never a failed request.
* :class:`MasterKeyError` -- the master key is missing, unreadable, or not this index's.
* :class:`CacheNotFoundError` -- a root (or index) holds no tenantkv cache and the caller did not
  ask to create one (``open(..., create=False)``: every CLI command but ``init``, ``demo`` and
  ``walkthrough``). Nothing was created.
* :class:`DeploymentError` -- a deployment under test (``tenantkv conformance``) answered a
  request of the suite with an error, or not at all, so the run could not go on.
* :class:`SchemaVersionError` -- the index's schema is not this version's: older (run
  ``tenantkv db upgrade``) or newer (tenantkv does not downgrade). Nothing was changed.
* :class:`JobNotFoundError`, :class:`JobStateError` -- jobs (long operations run apart from
  the request that started them): no such job, or one that cannot do what was asked (resume a
  job that did not fail or get interrupted).

Every one is a :class:`TenantKVError`. The leaf packages (``tenantkv.crypto``, ``.storage``,
``.audit``) keep their own error types, since they import nothing of tenantkv's; the services
wrap them where they reach a caller (a crypto master-key error is also a
:class:`MasterKeyError` here, a storage failure a :class:`CacheUnavailableError`).
"""

from __future__ import annotations

from .crypto import MasterKeyError as _CryptoMasterKeyError


class TenantKVError(Exception):
    """Base class of every error tenantkv raises on purpose."""


class InvalidRequestError(TenantKVError, ValueError):
    """The request is malformed; nothing was changed."""


class TenantExistsError(TenantKVError):
    """A tenant with this name already exists."""


class TenantNotFoundError(TenantKVError):
    """No tenant has this name."""


class CacheMissError(TenantKVError):
    """The requested prefix is not cached (or not all of it is)."""


class CacheClosedError(TenantKVError):
    """The cache (or a stream of it) was used after close()."""


class CacheUnavailableError(TenantKVError):
    """The index or block store failed: from ``open()`` (the index server cannot be reached),
    maintenance calls, and the serving path in strict mode."""


class LoadError(TenantKVError):
    """A load stopped before delivering every layer.

    ``delivered_layers`` is how many layers, from layer 0, were handed to the caller intact before
    the failure; any layer at or after it must not be used.
    """

    def __init__(self, message: str, *, delivered_layers: int) -> None:
        super().__init__(message)
        self.delivered_layers = delivered_layers


class LoadRevokedError(LoadError):
    """The tenant was deleted, or a data-key version the load reads was retired, while the load
    ran: it stopped before handing over another layer."""


class SegmentIntegrityError(LoadError):
    """A stored segment failed to open: the extent was evicted and a security event recorded."""


class CacheNotFoundError(TenantKVError):
    """The root holds no tenantkv cache (a mistyped path, an empty index) and the opening was not
    allowed to create one; nothing was created, not even the root directory or a key file."""


class SchemaVersionError(TenantKVError):
    """The index's schema revision is not the one this tenantkv uses; the message names the
    command that upgrades it (or says it is newer). Opening changed nothing."""


class MasterKeyError(TenantKVError, _CryptoMasterKeyError):
    """The master key could not be had, or does not open this cache's index. Also a
    ``tenantkv.crypto.MasterKeyError``, so either can be caught."""


class TenantAssertionError(TenantKVError):
    """A tenant assertion was refused (``tenantkv.tenant_assertion``); ``reason`` is one of that
    module's reason names (``missing``, ``malformed``, ``unknown_key``, ``forged``, ``expired``,
    ``not_yet_valid``, ``too_long_lived``, ``wrong_audience``, ``no_incarnation``,
    ``stale_incarnation``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class QuotaExceededError(TenantKVError):
    """A store (or a quota) does not fit: the tenant's quota, or the cache's capacity."""


class DeploymentError(TenantKVError):
    """The deployment ``tenantkv conformance`` tests (gateway or backend) failed a request the
    suite needs: an HTTP error, an answer that is not the OpenAI shape, or no answer."""


class JobNotFoundError(TenantKVError):
    """No job has this id (``tenantkv.services.jobs``)."""


class JobStateError(TenantKVError):
    """The job is not in a state that allows what was asked (only an interrupted or failed job
    resumes); nothing was changed."""
