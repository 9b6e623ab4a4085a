"""Signed tenant assertions: how a serving engine learns the tenant from something a client
cannot choose.

An engine's request carries whatever the client sent; vLLM's ``cache_salt`` and SGLang's
extra keys are chosen by the caller, so they cannot select a tenant. The gateway that
authenticated the caller signs a short-lived assertion naming the tenant (and optionally a
scope, e.g. an end user, and the deployment it is meant for) and passes it beside the request
(vLLM: ``kv_transfer_params["tenantkv_assertion"]``). Every node verifies it with the
gateway's public key; it holds no key that could mint one.

Format (one ASCII string, like a compact JWS)::

    tkva1.<payload>.<signature>

``payload`` is base64url (no padding) of canonical JSON
``{"aud": str|null, "exp": int, "iat": int, "inc": str, "kid": str, "scp": str|null, "ten": str,
"v": 1}`` (``inc`` only when the gateway knows it, see below);
``signature`` is base64url of the 64-byte Ed25519 signature over the ASCII bytes
``tkva1.<payload>``. ``kid`` names the gateway key (the first 16 bytes of SHA-256 of its raw
public key, in hex, as the audit log names its signing keys), so nodes can hold several keys
while a gateway key is rotated. Times are whole seconds since the epoch.

Verification checks, in this order, and stops at the first failure: size and shape, a known
``kid``, the signature (nothing in the payload is believed before it), then the fields,
expiry, issue time (allowing ``clock_skew``), lifetime (at most ``max_lifetime``), audience and,
with ``require_incarnation``, that ``inc`` is there.
A failure raises :class:`~tenantkv.errors.TenantAssertionError` whose ``reason`` says which
check failed; engines turn it into a miss plus a security event, never an error for the
request.

An assertion names a tenant, and a tenant deleted and created again under the same name is
another tenant (another incarnation: new keys, new id, empty cache). So an assertion is bound to
the incarnation it was issued for, checked against the tenant the cache holds now
(:meth:`AssertionVerifier.check_incarnation`, which engines call once they have looked the
tenant up): it is refused (``stale_incarnation``) when its ``inc`` names another incarnation,
or when it was issued before the tenant was created, allowing ``clock_skew``. ``inc`` is the
tenant's incarnation id (``TenantInfo.incarnation``: its random 16-byte id in hex, also in the
admin API's tenant records), which the gateway fetches and passes to :meth:`AssertionSigner.sign`.
The time comparison alone cannot tell an assertion issued to a tenant deleted and re-created
within ``clock_skew`` from one issued to the new tenant; ``inc`` can, and a verifier with
``require_incarnation`` refuses assertions without it (``no_incarnation``).

An assertion is a bearer token until it expires: keep lifetimes short (the default maximum is
5 minutes) and pass it only from the gateway to the engine, never back to the client.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    PublicFormat,
    load_pem_private_key,
    load_pem_public_key,
)

from .audit.signing import key_id_of
from .errors import InvalidRequestError, TenantAssertionError

PREFIX: Final = "tkva1"
#: The key of ``kv_transfer_params`` (vLLM) or of the extra config / request metadata (SGLang)
#: that carries the gateway's assertion (here, below both the gateways that set it and the
#: engines that read it).
ASSERTION_PARAM: Final = "tenantkv_assertion"
#: Longest assertion accepted; anything longer is refused before any parsing.
MAX_ASSERTION_CHARS: Final = 2048
#: Longest lifetime (exp - iat) a verifier accepts unless configured otherwise.
DEFAULT_MAX_LIFETIME: Final = 300.0
#: How far a gateway's clock may run ahead of a node's (or behind it, for the creation check).
DEFAULT_CLOCK_SKEW: Final = 30.0
#: Bounds of the settings: an assertion is a bearer token, so no node accepts one living over an
#: hour, nor a gateway clock more than ten minutes off; a signer mints nothing longer either.
MAX_LIFETIME_LIMIT: Final = 3600.0
MAX_CLOCK_SKEW: Final = 600.0
_MAX_LABEL = 256
_SIGNATURE_BYTES = 64

# The reasons a TenantAssertionError carries (also the detail of the security event).
MISSING: Final = "missing"
MALFORMED: Final = "malformed"
UNKNOWN_KEY: Final = "unknown_key"
FORGED: Final = "forged"
EXPIRED: Final = "expired"
NOT_YET_VALID: Final = "not_yet_valid"
TOO_LONG_LIVED: Final = "too_long_lived"
WRONG_AUDIENCE: Final = "wrong_audience"
NO_INCARNATION: Final = "no_incarnation"
STALE_INCARNATION: Final = "stale_incarnation"
#: An incarnation id: the tenant's random 16-byte id in lowercase hex.
_INCARNATION_HEX = 32


@dataclass(frozen=True)
class TenantAssertion:
    """What a verified assertion says: whose request this is, until when."""

    tenant: str
    scope: str | None
    audience: str | None
    issued_at: int
    expires_at: int
    key_id: str
    #: The tenant incarnation the gateway issued it for (None: the gateway did not say).
    incarnation: str | None = None


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    if not text or not text.isascii():
        raise TenantAssertionError(MALFORMED, "empty or non-ASCII part")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise TenantAssertionError(MALFORMED, "a part is not base64url") from None


def _check_label(name: str, value: Any, *, optional: bool) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > _MAX_LABEL:
        raise TenantAssertionError(MALFORMED, f"{name} must be a string of 1-{_MAX_LABEL} chars")
    if not value.isprintable():
        raise TenantAssertionError(MALFORMED, f"{name} must be printable")
    return value


def _check_incarnation_id(value: Any) -> str:
    if (
        not isinstance(value, str)
        or len(value) != _INCARNATION_HEX
        or value.strip("0123456789abcdef")
    ):
        raise TenantAssertionError(
            MALFORMED, f"inc must be {_INCARNATION_HEX} lowercase hex characters"
        )
    return value


def check_seconds(
    name: str, value: Any, *, minimum: float, maximum: float, open_minimum: bool = False
) -> float:
    """``value`` as seconds if it is a finite number from ``minimum`` (excluded with
    ``open_minimum``) to ``maximum``; else :class:`InvalidRequestError` naming the setting. NaN
    compares false with everything, so a NaN lifetime or skew would switch its check off."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{name} must be a number of seconds, got {value!r}")
    low_ok = value > minimum if open_minimum else value >= minimum
    if not math.isfinite(value) or not low_ok or value > maximum:
        low = f"more than {minimum:g}" if open_minimum else f"{minimum:g}"
        raise InvalidRequestError(
            f"{name} must be a finite number of seconds from {low} to {maximum:g}, got {value!r}"
        )
    return float(value)


def lifetime_setting(name: str, raw: Any) -> float:
    """A node's configured ``max_lifetime`` (engines' ``max_assertion_lifetime``: a number or
    its text, from a JSON or command-line config; absent: the default), checked as the
    verifier checks it, with the error naming the setting as the operator wrote it."""
    if raw is None:
        return DEFAULT_MAX_LIFETIME
    if isinstance(raw, str):
        try:
            raw = float(raw)
        except ValueError:
            raise InvalidRequestError(f"{name} must be a number of seconds, got {raw!r}") from None
    return check_seconds(name, raw, minimum=1.0, maximum=MAX_LIFETIME_LIMIT)


def gateway_key_id(public_key: Ed25519PublicKey) -> str:
    """The ``kid`` that assertions signed with this key's private half carry."""
    return key_id_of(public_key.public_bytes(Encoding.Raw, PublicFormat.Raw))


def public_key_pem(public_key: Ed25519PublicKey) -> bytes:
    """SubjectPublicKeyInfo PEM of a gateway key, the form nodes are configured with."""
    return public_key.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)


def load_public_key(pem: bytes | str) -> Ed25519PublicKey:
    """A gateway's Ed25519 public key from PEM; anything else is a configuration error."""
    data = pem.encode("ascii") if isinstance(pem, str) else pem
    try:
        key = load_pem_public_key(data)
    except ValueError as err:
        raise InvalidRequestError(f"not a PEM public key: {err}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise InvalidRequestError("gateway keys are Ed25519")
    return key


class AssertionSigner:
    """The gateway's half: signs assertions for callers it has authenticated.

    ``clock`` is injectable for tests. Keep the private key on the gateway only.
    """

    def __init__(
        self,
        private_key: Ed25519PrivateKey | bytes | str,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(private_key, bytes | str):
            data = private_key.encode("ascii") if isinstance(private_key, str) else private_key
            loaded = load_pem_private_key(data, password=None)
            if not isinstance(loaded, Ed25519PrivateKey):
                raise InvalidRequestError("gateway keys are Ed25519")
            private_key = loaded
        self._key = private_key
        self._clock = clock
        self.key_id = gateway_key_id(private_key.public_key())

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._key.public_key()

    def sign(
        self,
        tenant: str,
        *,
        scope: str | None = None,
        audience: str | None = None,
        ttl: float = 60.0,
        incarnation: str | None = None,
    ) -> str:
        """An assertion that ``tenant`` (and ``scope``) sent this request, valid ``ttl`` s.

        ``incarnation`` (the tenant's ``TenantInfo.incarnation``) binds it to the tenant as it
        is now: should the tenant be deleted and created again, the assertion is refused."""
        try:
            _check_label("tenant", tenant, optional=False)
            _check_label("scope", scope, optional=True)
            _check_label("audience", audience, optional=True)
            if incarnation is not None:
                _check_incarnation_id(incarnation)
        except TenantAssertionError as err:
            raise InvalidRequestError(str(err)) from None
        ttl = check_seconds("ttl", ttl, minimum=0.0, maximum=MAX_LIFETIME_LIMIT, open_minimum=True)
        now = int(self._clock())
        claims: dict[str, Any] = {
            "aud": audience,
            "exp": now + max(1, int(ttl)),
            "iat": now,
            "kid": self.key_id,
            "scp": scope,
            "ten": tenant,
            "v": 1,
        }
        if incarnation is not None:
            claims["inc"] = incarnation
        canonical = json.dumps(claims, sort_keys=True, separators=(",", ":"))
        signed = f"{PREFIX}.{_b64encode(canonical.encode('utf-8'))}"
        return f"{signed}.{_b64encode(self._key.sign(signed.encode('ascii')))}"


class AssertionVerifier:
    """The node's half: accepts assertions signed by the configured gateway keys only.

    ``audience``, when set, must equal the assertion's ``aud`` (an assertion minted for another
    deployment is refused); an assertion with an audience is refused by a verifier without one.
    ``max_lifetime`` (seconds, 1 to ``MAX_LIFETIME_LIMIT``) and ``clock_skew`` (0 to
    ``MAX_CLOCK_SKEW``) must be finite: a NaN would make their comparisons false and switch the
    checks off. ``require_incarnation`` refuses assertions that do not name the tenant's
    incarnation (the only binding that holds when a tenant is re-created within the skew).
    """

    def __init__(
        self,
        public_keys: Iterable[Ed25519PublicKey],
        *,
        audience: str | None = None,
        max_lifetime: float = DEFAULT_MAX_LIFETIME,
        clock_skew: float = DEFAULT_CLOCK_SKEW,
        require_incarnation: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # Lifetimes are whole seconds, at least 1: a maximum below 1 s would refuse them all.
        self._max_lifetime = check_seconds(
            "max_lifetime", max_lifetime, minimum=1.0, maximum=MAX_LIFETIME_LIMIT
        )
        self._skew = check_seconds("clock_skew", clock_skew, minimum=0.0, maximum=MAX_CLOCK_SKEW)
        if not isinstance(require_incarnation, bool):
            raise InvalidRequestError(
                f"require_incarnation must be True or False, got {require_incarnation!r}"
            )
        self._keys: dict[str, Ed25519PublicKey] = {gateway_key_id(k): k for k in public_keys}
        if not self._keys:
            raise InvalidRequestError("a verifier needs at least one gateway key")
        self._audience = audience
        self._require_incarnation = require_incarnation
        self._clock = clock

    @classmethod
    def from_pem(cls, pems: Iterable[bytes | str], **options: Any) -> AssertionVerifier:
        return cls([load_public_key(pem) for pem in pems], **options)

    def verify(self, assertion: Any) -> TenantAssertion:
        """The assertion's claims, or TenantAssertionError naming the check that failed."""
        if assertion is None or assertion == "":
            raise TenantAssertionError(MISSING, "no tenant assertion")
        if not isinstance(assertion, str) or len(assertion) > MAX_ASSERTION_CHARS:
            raise TenantAssertionError(MALFORMED, "not a string of acceptable length")
        parts = assertion.split(".")
        if len(parts) != 3 or parts[0] != PREFIX:
            raise TenantAssertionError(MALFORMED, f"not a {PREFIX} assertion")
        payload = _b64decode(parts[1])
        signature = _b64decode(parts[2])
        if len(signature) != _SIGNATURE_BYTES:
            raise TenantAssertionError(MALFORMED, "bad signature length")
        key = self._keys.get(self._unverified_key_id(payload))
        if key is None:
            raise TenantAssertionError(UNKNOWN_KEY, "signed by no configured gateway key")
        try:
            key.verify(signature, f"{parts[0]}.{parts[1]}".encode("ascii"))
        except InvalidSignature:
            raise TenantAssertionError(FORGED, "the signature does not verify") from None
        return self._check_claims(self._parse(payload))

    @staticmethod
    def _parse(payload: bytes) -> Mapping[str, Any]:
        try:
            claims = json.loads(payload.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise TenantAssertionError(MALFORMED, "the payload is not JSON") from None
        if not isinstance(claims, dict):
            raise TenantAssertionError(MALFORMED, "the payload is not an object")
        return claims

    def _unverified_key_id(self, payload: bytes) -> str:
        """Only to pick the key that checks the signature; nothing else is read before it."""
        kid = self._parse(payload).get("kid")
        return kid if isinstance(kid, str) else ""

    def _check_claims(self, claims: Mapping[str, Any]) -> TenantAssertion:
        if claims.get("v") != 1:
            raise TenantAssertionError(MALFORMED, "unknown assertion version")
        tenant = _check_label("tenant", claims.get("ten"), optional=False)
        scope = _check_label("scope", claims.get("scp"), optional=True)
        audience = _check_label("audience", claims.get("aud"), optional=True)
        issued, expires = claims.get("iat"), claims.get("exp")
        for name, value in (("iat", issued), ("exp", expires)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TenantAssertionError(MALFORMED, f"{name} must be an integer")
        assert isinstance(issued, int) and isinstance(expires, int) and tenant is not None
        now = self._clock()
        if expires <= now:
            raise TenantAssertionError(EXPIRED, f"expired {now - expires:.0f} s ago")
        if issued > now + self._skew:
            raise TenantAssertionError(NOT_YET_VALID, "issued in the future")
        if expires - issued > self._max_lifetime:
            raise TenantAssertionError(
                TOO_LONG_LIVED, f"lifetime {expires - issued} s > {self._max_lifetime:.0f} s"
            )
        if audience != self._audience:
            raise TenantAssertionError(WRONG_AUDIENCE, "minted for another deployment")
        raw_incarnation = claims.get("inc")
        incarnation = None if raw_incarnation is None else _check_incarnation_id(raw_incarnation)
        if incarnation is None and self._require_incarnation:
            raise TenantAssertionError(NO_INCARNATION, "names no tenant incarnation")
        return TenantAssertion(
            tenant, scope, audience, issued, expires, str(claims.get("kid")), incarnation
        )

    def check_incarnation(
        self, claims: TenantAssertion, *, incarnation: str, created_at: float
    ) -> None:
        """Refuse (``stale_incarnation``) an assertion issued for an earlier tenant of its name:
        one naming another incarnation, or issued before the tenant that holds the name now was
        created (``created_at``, the node's clock), allowing ``clock_skew`` since the gateway's
        clock may run behind. Without ``inc`` only the time tells them apart, so a tenant
        deleted and re-created within the skew still accepts the old tenant's assertions: bind
        them with ``inc`` (and ``require_incarnation``) to close that too."""
        if claims.incarnation is not None and claims.incarnation != incarnation:
            raise TenantAssertionError(
                STALE_INCARNATION, f"issued for an earlier tenant named {claims.tenant!r}"
            )
        if claims.issued_at + self._skew < math.floor(created_at):
            raise TenantAssertionError(
                STALE_INCARNATION,
                f"issued {math.floor(created_at) - claims.issued_at} s before tenant "
                f"{claims.tenant!r} was created",
            )
