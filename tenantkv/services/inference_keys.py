"""Inference keys: what a gateway's clients present (``Authorization: Bearer tkvi_...``) to be
served as one (tenant, scope). Minted, listed and revoked by an operator or by the tenant's own
tenant-admin (the admin API, the CLI); authenticated by the gateway on every request.

A key is ``tkvi_<43 url-safe characters>`` (256 random bits), shown once when it is made. Its
prefix differs from the admin tokens' (``tkv_``): each service refuses the other's form before
any lookup, and the two are stored in different tables, so an admin token never authenticates
as an inference key nor the reverse. The index keeps only ``sha256(key)``; the key id (the
first 16 hex digits of that hash) names it in listings, audit records and revocation.

A key is bound to its tenant's incarnation (the tenant's immutable id): deleting the tenant
revokes its keys in the deletion's transaction, and the lookup joins the tenant's row by id,
so a key of a deleted tenant authenticates nothing even once another tenant takes the name.

Mint and revoke are audited, each in its own transaction. Use is counted per key
(``uses``, ``last_used_at``) in memory and written in batches (``components/key_uses.py``),
never audited per request: :meth:`InferenceKeyService.authenticate` reads one row and writes
nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from typing import Any, Final

from ..audit import Attribution
from ..components.context import CacheContext
from ..components.key_uses import DEFAULT_FLUSH_INTERVAL_S, KeyUses
from ..errors import InvalidRequestError, TenantNotFoundError
from ..index import inference_keys as key_rows
from ..index import tenants as tenant_rows
from ..index.api_tokens import tenant_id_for_mint
from ..index.failures import typed_failures
from ..index.inference_keys import InferenceKey
from .tenants import check_tenant_name, incarnation_hex
from .tokens import check_lifetime

KEY_PREFIX: Final = "tkvi_"
MAX_EXPIRES_IN: Final = 366 * 86400.0
MAX_SCOPE: Final = 256
KEY_CREATE: Final = "inference_key.create"
KEY_REVOKE: Final = "inference_key.revoke"
_KEY = re.compile(r"tkvi_[A-Za-z0-9_-]{43}")
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class InferenceIdentity:
    """Who a valid inference key serves: what a gateway puts in its tenant assertion."""

    key_id: str
    tenant: str
    scope: str | None
    #: The tenant's incarnation (``TenantInfo.incarnation``) the key was minted for.
    incarnation: str


@dataclass(frozen=True)
class InferenceKeyInfo:
    """What a listing shows of a key (never the key or its hash). ``uses`` and
    ``last_used_at`` are what the index holds (a listing writes this node's pending counts
    first; other nodes' arrive within their flush interval)."""

    id: str
    name: str
    tenant: str
    scope: str | None
    created_at: float
    created_by: str
    expires_at: float | None
    revoked_at: float | None
    uses: int
    last_used_at: float | None


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def key_id_of(secret: str) -> str:
    """The public id of ``secret`` (what listings, audit records and revocation use)."""
    return hash_key(secret)[:16]


def check_key_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(
            f"key name {name!r} is invalid: 1-128 characters of letters, digits, '.', '_' or "
            "'-', starting with a letter or digit"
        )
    return name


def _check_scope(scope: Any) -> str | None:
    if scope is None:
        return None
    if not isinstance(scope, str) or not scope or len(scope) > MAX_SCOPE or not scope.isprintable():
        raise InvalidRequestError(f"scope must be a printable string of 1-{MAX_SCOPE} characters")
    return scope


def _check_expires_in(expires_in: Any) -> float | None:
    return check_lifetime("expires_in", expires_in, MAX_EXPIRES_IN)


def _check_key_id(key_id: Any) -> str:
    if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
        raise InvalidRequestError("a key id is 16 lower-case hex digits")
    return key_id


@typed_failures
class InferenceKeyService:
    """The inference keys over one open cache's components (``kv.inference_keys``).

    Calls without ``actor`` act as the cache's own process (the CLI); the admin API passes its
    caller's attribution, so the audit records name the caller. Who may call is the edge's
    business (the admin API admits operators, and a tenant-admin for its own tenant only)."""

    def __init__(self, ctx: CacheContext, flush_interval: float = DEFAULT_FLUSH_INTERVAL_S) -> None:
        self._ctx = ctx
        self._uses = KeyUses(ctx.index, flush_interval)

    def create(
        self,
        tenant: str,
        name: str,
        *,
        scope: str | None = None,
        expires_in: float | None = None,
        actor: Attribution | None = None,
    ) -> tuple[InferenceKeyInfo, str]:
        """Mint a key for (``tenant``, ``scope``), expiring ``expires_in`` seconds from now
        (None: never), audited in the same transaction; return what listings show of it and
        the key itself (shown once: only its hash is kept). TenantNotFoundError if there is no
        such tenant."""
        check_tenant_name(tenant)
        check_key_name(name)
        checked_scope = _check_scope(scope)
        ttl = _check_expires_in(expires_in)
        by = actor or self._ctx.attribution
        with self._ctx.index.write() as session:
            # Share-locked until the mint commits: a deletion racing it waits, then revokes it.
            tenant_id = tenant_id_for_mint(session, tenant)
            if tenant_id is None:
                raise TenantNotFoundError(f"no tenant named {tenant!r}")
            now = self._ctx.clock()
            secret = KEY_PREFIX + secrets.token_urlsafe(32)
            digest = hash_key(secret)
            row = InferenceKey(
                id=digest[:16],
                key_hash=digest,
                name=name,
                tenant=tenant,
                tenant_id=tenant_id,
                scope=checked_scope,
                created_at=now,
                created_by=by.actor,
                expires_at=None if ttl is None else now + ttl,
                revoked_at=None,
                uses=0,
                last_used_at=None,
            )
            key_rows.add(session, row)
            self._ctx.audit.append(
                session,
                by.event(
                    tenant,
                    KEY_CREATE,
                    row.id,
                    details={
                        "key_id": row.id,
                        "name": name,
                        "scope": checked_scope,
                        "expires_at": row.expires_at,
                    },
                    tenant_id=tenant_id,
                ),
            )
            return self._info(row), secret

    def list(self, tenant: str) -> list[InferenceKeyInfo]:
        """The keys of ``tenant``'s current incarnation, newest first, without secrets
        (revoked and expired ones included, marked by their times). TenantNotFoundError if
        there is no such tenant. This node's pending use counts are written first."""
        check_tenant_name(tenant)
        self._uses.flush()
        with self._ctx.index.read() as session:
            tenant_id = tenant_rows.id_of(session, tenant)
            if tenant_id is None:
                raise TenantNotFoundError(f"no tenant named {tenant!r}")
            return [self._info(row) for row in key_rows.listing(session, tenant_id)]

    def revoke(self, tenant: str, key_id: str, *, actor: Attribution | None = None) -> bool:
        """Revoke the key ``key_id`` of ``tenant``'s current incarnation, audited in the same
        transaction; False if it has no such key (a key of another tenant included).
        TenantNotFoundError if there is no such tenant."""
        check_tenant_name(tenant)
        _check_key_id(key_id)
        by = actor or self._ctx.attribution
        with self._ctx.index.write() as session:
            tenant_id = tenant_rows.id_of(session, tenant)
            if tenant_id is None:
                raise TenantNotFoundError(f"no tenant named {tenant!r}")
            row = key_rows.find(session, key_id, tenant_id)
            if row is None:
                return False
            if row.revoked_at is None:
                row.revoked_at = self._ctx.clock()
            self._ctx.audit.append(
                session,
                by.event(
                    tenant,
                    KEY_REVOKE,
                    row.id,
                    details={"key_id": row.id, "name": row.name},
                    tenant_id=tenant_id,
                ),
            )
            return True

    def authenticate(self, secret: str) -> InferenceIdentity | None:
        """Who ``secret`` serves, or None for a malformed, unknown, revoked or expired key or
        one whose tenant incarnation is gone. One read by the key's hash on the serving path's
        bound; nothing written (the use is counted in memory).
        CacheUnavailableError when the index cannot say."""
        if not isinstance(secret, str) or not _KEY.fullmatch(secret):
            return None
        digest = hash_key(secret)
        with self._ctx.index.read(serving=True) as session:
            found = key_rows.by_hash(session, digest)
        if found is None:
            return None
        row, tenant_id = found
        if not hmac.compare_digest(row.key_hash, digest) or row.tenant_id != tenant_id:
            return None
        now = self._ctx.clock()
        if row.revoked_at is not None or (row.expires_at is not None and now >= row.expires_at):
            return None
        self._uses.record(row.id, now)
        return InferenceIdentity(
            key_id=row.id,
            tenant=row.tenant,
            scope=row.scope,
            incarnation=incarnation_hex(tenant_id),
        )

    def flush_uses(self) -> None:
        """Write this node's pending use counts now (a timer does it within the flush
        interval, and closing the cache does it too)."""
        self._uses.flush()

    def close(self) -> None:
        """Stop the use counts' timer and write what is pending (called by the cache's close)."""
        self._uses.close()

    def _info(self, row: InferenceKey) -> InferenceKeyInfo:
        return InferenceKeyInfo(
            id=row.id,
            name=row.name,
            tenant=row.tenant,
            scope=row.scope,
            created_at=row.created_at,
            created_by=row.created_by,
            expires_at=row.expires_at,
            revoked_at=row.revoked_at,
            uses=row.uses,
            last_used_at=row.last_used_at,
        )
