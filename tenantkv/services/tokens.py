"""Bearer tokens of the admin API: creation, verification, revocation, operator bootstrap.

A token is ``tkv_<43 url-safe characters>`` (256 random bits), shown once when it is made. The
index keeps only ``sha256(token)`` (see ``tenantkv.index.api_tokens``); a presented token is
hashed, the row found by its hash, and the stored and computed digests compared with
``hmac.compare_digest``. The token id (the first 16 hex digits of that hash) names a token in
listings, audit records and revocation without revealing it; a holder can compute it from the
token.

The first operator token is made once per index, when it is created (``tenantkv init``), and
expires (24 h by default); a lost operator is recovered on the host with ``tenantkv token
recover``, never by a server printing a new token at start.

Roles: ``operator`` (every tenant, tokens, checkpoints), ``tenant-admin`` (its own tenant only),
``auditor`` (read-only: audit exports and the public key).

A token is bound to its tenant's immutable id and to the token that minted it (see
``tenantkv.index.api_tokens``): it is valid only while every token up its chain of minters is
unrevoked and unexpired and its tenant still exists. :meth:`TokenService.authenticate` checks
that chain at every request, and a mint checks its minter's chain again inside its own write
transaction, with the tenant row share-locked, so a revocation or deletion that commits first
wins. Revoking a token therefore revokes everything minted under it, without touching those rows.

This is a service over the cache's components, not part of the HTTP server: the CLI makes and
revokes tokens through it without the server extras installed, and every change writes its
audit record in its own transaction.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from ..audit import ROLE_AUDITOR, ROLE_OPERATOR, ROLE_TENANT_ADMIN, Attribution
from ..components.context import CacheContext
from ..errors import CacheUnavailableError, InvalidRequestError, TenantNotFoundError
from ..index import api_tokens
from ..index import tenants as tenant_rows
from ..index.api_tokens import ApiToken
from ..index.failures import typed_failures
from ..token_limits import BOOTSTRAP_TTL_SECONDS as BOOTSTRAP_TTL_SECONDS
from ..token_limits import MAX_TTL_SECONDS as MAX_TTL_SECONDS
from ..token_limits import ROLES as ROLES
from ..token_limits import Role as Role
from .tenants import check_tenant_name

assert ROLES == (ROLE_OPERATOR, ROLE_TENANT_ADMIN, ROLE_AUDITOR), "roles out of step with audit"
TOKEN_PREFIX: Final = "tkv_"
TOKEN_CREATE: Final = "token.create"
TOKEN_REVOKE: Final = "token.revoke"
BOOTSTRAP_TURN: Final = "operator-bootstrap"
_TOKEN = re.compile(r"tkv_[A-Za-z0-9_-]{43}")
_TOKEN_ID = re.compile(r"[0-9a-f]{16}")
#: A token's name: what it is for, shown in listings and ``whoami`` (never secret).
_TOKEN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's id, role and (for a tenant-admin) tenant, by name and by
    immutable id."""

    token_id: str
    role: Role
    tenant: str | None
    expires_at: float | None = None
    tenant_id: bytes | None = None

    @property
    def actor(self) -> str:
        return f"token:{self.token_id}"


@dataclass(frozen=True)
class TokenInfo:
    """What a listing shows of a token (never the token or its hash)."""

    id: str
    role: Role
    tenant: str | None
    created_at: float
    created_by: str
    expires_at: float | None
    revoked_at: float | None
    minted_by: str | None = None  # the id of the token that minted it (None: the process/CLI)
    name: str | None = None  # what it is for (None: made unnamed, or before names existed)


@dataclass(frozen=True)
class IssuedToken:
    """A token just made: the secret (shown once, never stored) and what listings show of it."""

    token: str
    info: TokenInfo


class AuthError(Exception):
    """A presented token is missing, malformed, unknown, expired or revoked (``reason``)."""

    def __init__(self, reason: str, token_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.token_id = token_id


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def token_id_of(token: str) -> str:
    """The public id of ``token`` (what listings, audit records and revocation use)."""
    return hash_token(token)[:16]


def _check_role(role: Any) -> Role:
    for known in ROLES:
        if role == known:
            return known
    raise InvalidRequestError(f"role {role!r} must be one of {', '.join(ROLES)}")


def check_lifetime(name: str, seconds: Any, maximum: float) -> float | None:
    """A credential's lifetime as given (None: no expiry of its own): a finite number of
    seconds in (0, ``maximum``]. Shared by admin tokens and inference keys."""
    if seconds is None:
        return None
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or not 0 < seconds <= maximum
    ):
        raise InvalidRequestError(f"{name} must be more than 0 and at most {int(maximum)} seconds")
    return float(seconds)


def _check_ttl(ttl_seconds: Any) -> float | None:
    return check_lifetime("ttl_seconds", ttl_seconds, MAX_TTL_SECONDS)


def _info(row: ApiToken) -> TokenInfo:
    return TokenInfo(
        id=row.id,
        role=_check_role(row.role),
        tenant=row.tenant,
        created_at=row.created_at,
        created_by=row.created_by,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
        minted_by=row.minted_by,
        name=row.name,
    )


def check_token_name(name: Any) -> str | None:
    """A token's name as given (None: unnamed): 1 to 128 letters, digits and ``._@-``,
    starting with a letter or digit."""
    if name is None:
        return None
    if not isinstance(name, str) or not _TOKEN_NAME.fullmatch(name):
        raise InvalidRequestError(
            "a token name is 1 to 128 letters, digits, '.', '_', '@' or '-', starting with a "
            "letter or digit"
        )
    return name


@typed_failures
class TokenService:
    """The admin API's tokens over one open cache's components (``kv.tokens``).

    Calls without ``by`` act as the cache's own process (its attribution, no minter: the CLI
    and the server's bootstrap); the admin API passes its caller's attribution and principal,
    so the audit records name the caller and a mint is bound to its minter."""

    def __init__(self, ctx: CacheContext) -> None:
        self._ctx = ctx

    # ---- making -------------------------------------------------------------------------------

    def issue(
        self,
        role: Any,
        tenant: str | None = None,
        ttl_seconds: Any = None,
        *,
        by: Attribution | None = None,
        minter: Principal | None = None,
        name: str | None = None,
    ) -> IssuedToken:
        """Make a token in one write transaction, audited in it (only its hash is stored).

        ``minter`` is the authenticated caller whose token makes this one (None: the cache's
        own process). Its chain is checked again inside the mint's transaction, so a minter
        revoked, or a tenant deleted, by a transaction that committed first cannot mint
        (AuthError, or TenantNotFoundError for a tenant that is gone)."""
        with self._ctx.index.write() as session:
            return self._insert(
                session, role, tenant, ttl_seconds, by or self._ctx.attribution, minter, name=name
            )

    def create(
        self,
        role: Role,
        tenant: str | None = None,
        ttl_seconds: float | None = None,
        name: str | None = None,
    ) -> str:
        """Make a token as the cache's own process; return it (shown once)."""
        return self.issue(role, tenant, ttl_seconds, name=name).token

    def ensure_first_operator(self, ttl_seconds: float = BOOTSTRAP_TTL_SECONDS) -> str | None:
        """The index's bootstrap operator token, made once per index: a new operator token,
        expiring after ``ttl_seconds`` (default 24 h), if no operator token was ever made on
        this index; else None.

        Once, not "whenever none is usable": a server that printed a fresh token at every
        start finding none usable put a never-expiring operator token in its logs after each
        revocation. A lost or revoked operator is recovered on the host, with the master key,
        by :meth:`recover_operator` (``tenantkv token recover``). Checked and made in one write
        transaction taking turns with any other bootstrap, so two processes initialising one
        index together do not both get a token."""
        ttl = _check_ttl(ttl_seconds)
        if ttl is None:
            raise InvalidRequestError("a bootstrap operator token needs an expiry")
        with self._ctx.index.write() as session:
            self._ctx.index.take_turns(session, BOOTSTRAP_TURN)
            if api_tokens.any_operator(session):
                return None
            issued = self._insert(
                session, ROLE_OPERATOR, None, ttl, self._ctx.attribution, None, purpose="bootstrap"
            )
            return issued.token

    def recover_operator(
        self, by: Attribution, ttl_seconds: float = BOOTSTRAP_TTL_SECONDS
    ) -> IssuedToken:
        """A new operator token, expiring after ``ttl_seconds``, for whoever can open the cache
        on its host (the index and the master key): the way back in when every operator token
        is lost, revoked or expired. Audited as a ``token.create`` naming ``by`` and the
        purpose ``recovery``."""
        ttl = _check_ttl(ttl_seconds)
        if ttl is None:
            raise InvalidRequestError("a recovered operator token needs an expiry")
        with self._ctx.index.write() as session:
            return self._insert(session, ROLE_OPERATOR, None, ttl, by, None, purpose="recovery")

    def bounded_ttl(self, minter: Principal, ttl: float | None, ceiling: float) -> float | None:
        """The lifetime of a token ``minter`` mints: a tenant-admin's never outlives the
        minter's own token (it cannot extend its credential by minting new ones), and without
        an expiry of its own it gets at most ``ceiling``; other roles' ``ttl`` as asked."""
        if minter.role != ROLE_TENANT_ADMIN:
            return ttl
        if minter.expires_at is not None:
            remaining = minter.expires_at - self._ctx.clock()
            return remaining if ttl is None else min(ttl, remaining)
        return ceiling if ttl is None else ttl

    def _insert(
        self,
        session: Session,
        role: Any,
        tenant: str | None,
        ttl_seconds: Any,
        by: Attribution,
        minter: Principal | None,
        purpose: str | None = None,
        name: str | None = None,
    ) -> IssuedToken:
        checked_role = _check_role(role)
        checked_name = check_token_name(name)
        ttl = _check_ttl(ttl_seconds)
        tenant_id: bytes | None = None
        if checked_role == ROLE_TENANT_ADMIN:
            if tenant is None:
                raise InvalidRequestError("a tenant-admin token needs a tenant")
            check_tenant_name(tenant)
            tenant_id = api_tokens.tenant_id_for_mint(session, tenant)
            if tenant_id is None:
                raise TenantNotFoundError(f"no tenant named {tenant!r}")
        elif tenant is not None:
            raise InvalidRequestError(f"a {checked_role} token is not bound to a tenant")
        now = self._ctx.clock()
        if minter is not None:
            _check_minter(session, minter, tenant_id, now)
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        digest = hash_token(token)
        row = ApiToken(
            id=digest[:16],
            token_hash=digest,
            role=checked_role,
            tenant=tenant,
            created_at=now,
            created_by=by.actor,
            expires_at=None if ttl is None else now + ttl,
            revoked_at=None,
            tenant_id=tenant_id,
            minted_by=None if minter is None else minter.token_id,
            name=checked_name,
        )
        api_tokens.add(session, row)
        details: dict[str, Any] = {
            "token_id": row.id,
            "role": checked_role,
            "expires_at": row.expires_at,
        }
        if checked_name is not None:
            details["name"] = checked_name
        if purpose is not None:  # the bootstrap, or a recovery on the host
            details["purpose"] = purpose
        self._ctx.audit.append(
            session,
            by.event(tenant, TOKEN_CREATE, row.id, details=details, tenant_id=tenant_id),
        )
        return IssuedToken(token, _info(row))

    # ---- revoking and listing -----------------------------------------------------------------

    def revoke(
        self, token_id: str, *, by: Attribution | None = None, tenant: str | None = None
    ) -> bool:
        """Revoke one token, audited in the same transaction; False if there is no such token
        (or, with ``tenant``, none of that tenant's current incarnation). Tokens it minted, and
        theirs, lapse with it (their chain now holds a revoked token)."""
        if not isinstance(token_id, str) or not _TOKEN_ID.fullmatch(token_id):
            raise InvalidRequestError("a token id is 16 lower-case hex digits")
        actor = by or self._ctx.attribution
        with self._ctx.index.write() as session:
            tenant_id: bytes | None = None
            if tenant is not None:
                tenant_id = tenant_rows.id_of(session, tenant)
                if tenant_id is None:
                    return False
            row = api_tokens.find(session, token_id, tenant_id)
            if row is None:
                return False
            if row.revoked_at is None:
                row.revoked_at = self._ctx.clock()
            self._ctx.audit.append(
                session,
                actor.event(
                    row.tenant,
                    TOKEN_REVOKE,
                    row.id,
                    details={"token_id": row.id, "role": row.role},
                    tenant_id=row.tenant_id if row.tenant is not None else None,
                ),
            )
            return True

    def listing(self, tenant: str | None = None) -> list[TokenInfo]:
        """Every token (or one tenant's current incarnation's), newest first, without secrets."""
        with self._ctx.index.read() as session:
            tenant_id = None if tenant is None else tenant_rows.id_of(session, tenant)
            if tenant is not None and tenant_id is None:
                return []
            return [_info(row) for row in api_tokens.listing(session, tenant_id)]

    def describe(self, token_id: str) -> TokenInfo | None:
        """One token's listing entry (``whoami``), or None if there is no such token."""
        if not isinstance(token_id, str) or not _TOKEN_ID.fullmatch(token_id):
            raise InvalidRequestError("a token id is 16 lower-case hex digits")
        with self._ctx.index.read() as session:
            row = api_tokens.find(session, token_id)
            return None if row is None else _info(row)

    # ---- authenticating -----------------------------------------------------------------------

    def authenticate(self, token: str | None) -> Principal:
        """The principal ``token`` authenticates, or raise AuthError with the reason
        (CacheUnavailableError when the index cannot say)."""
        if not token:
            raise AuthError("missing")
        if not _TOKEN.fullmatch(token):
            raise AuthError("malformed")
        digest = hash_token(token)
        try:
            with self._ctx.index.read() as session:
                row = api_tokens.by_hash(session, digest)
                if row is None or not hmac.compare_digest(row.token_hash, digest):
                    raise AuthError("unknown")
                links = api_tokens.chain_of(session, row.id)
                tenant = None
                if row.role == ROLE_TENANT_ADMIN:
                    if row.tenant_id is None:  # made by an older tenantkv for a replaced tenant
                        raise AuthError("unbound", row.id)
                    tenant = api_tokens.tenant_exists(session, row.tenant_id)
        except SQLAlchemyError as err:
            # The driver's text (statements, hosts) stays in the chained cause and the logs,
            # out of any answer a client might see.
            raise CacheUnavailableError("could not read the token table") from err
        problem = api_tokens.chain_problem(links, self._ctx.clock())
        if problem is not None:
            raise AuthError(problem, row.id)
        if row.role == ROLE_TENANT_ADMIN and tenant is None:
            raise AuthError("tenant-deleted", row.id)
        return Principal(
            token_id=row.id,
            role=_check_role(row.role),
            tenant=tenant,
            expires_at=row.expires_at,
            tenant_id=row.tenant_id,
        )


def _check_minter(session: Session, minter: Principal, tenant_id: bytes | None, now: float) -> None:
    """Refuse a mint whose minter is no longer valid, as seen inside the mint's transaction."""
    problem = api_tokens.chain_problem(api_tokens.chain_of(session, minter.token_id), now)
    if problem is not None:
        raise AuthError(problem, minter.token_id)
    if minter.role == ROLE_TENANT_ADMIN:
        # Its own tenant, the incarnation it was made for (locked above if it is the target).
        if minter.tenant_id is None or (
            tenant_id != minter.tenant_id
            and api_tokens.tenant_exists(session, minter.tenant_id, lock=True) is None
        ):
            raise AuthError("tenant-deleted", minter.token_id)
        if tenant_id is not None and tenant_id != minter.tenant_id:
            raise TenantNotFoundError("a tenant-admin mints for its own tenant only")
