"""Signed tenant assertions (tenantkv.tenant_assertion) and the engines' identity rule
(tenantkv.integrations.engine_identity): the tenant comes from the gateway's signature, never
from what the client chose. Engine-free, so it runs in the main suite; the engines' own tests
(tests_engines/) drive the same rule through vLLM and SGLang."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

import tenantkv
from tenantkv.errors import InvalidRequestError, TenantAssertionError
from tenantkv.integrations.engine_identity import (
    ASSERTION_PARAM,
    ASSERTION_REFUSED,
    EngineNamespaces,
    RequestTenant,
)
from tenantkv.tenant_assertion import (
    EXPIRED,
    FORGED,
    MALFORMED,
    MISSING,
    NOT_YET_VALID,
    TOO_LONG_LIVED,
    UNKNOWN_KEY,
    WRONG_AUDIENCE,
    AssertionSigner,
    AssertionVerifier,
    public_key_pem,
)
from tests.helpers import MHA_SMALL, ManualClock, random_layers, random_tokens

NOW = 1_800_000_000.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(NOW)


@pytest.fixture
def signer(clock: ManualClock) -> AssertionSigner:
    return AssertionSigner(Ed25519PrivateKey.generate(), clock=clock)


@pytest.fixture
def verifier(signer: AssertionSigner, clock: ManualClock) -> AssertionVerifier:
    return AssertionVerifier.from_pem([public_key_pem(signer.public_key)], clock=clock)


def refusal(verifier: AssertionVerifier, assertion: object) -> str:
    with pytest.raises(TenantAssertionError) as caught:
        verifier.verify(assertion)
    return caught.value.reason


def test_owner_assertion_verifies(signer: AssertionSigner, verifier: AssertionVerifier) -> None:
    claims = verifier.verify(signer.sign("acme", scope="user-7", ttl=60))
    assert (claims.tenant, claims.scope, claims.audience) == ("acme", "user-7", None)
    assert claims.expires_at - claims.issued_at == 60
    assert claims.key_id == signer.key_id


def test_missing_and_malformed_are_refused(verifier: AssertionVerifier) -> None:
    assert refusal(verifier, None) == MISSING
    assert refusal(verifier, "") == MISSING
    for junk in (42, "tenantA", "tkva1.a.b.c", "jwt.e30.e30", "tkva1.!!!.AAAA", "x" * 5000):
        assert refusal(verifier, junk) == MALFORMED, junk


def test_forged_assertions_are_refused(
    signer: AssertionSigner, verifier: AssertionVerifier, clock: ManualClock
) -> None:
    genuine = signer.sign("acme")
    prefix, payload, signature = genuine.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    # another tenant's name under the genuine signature
    claims["ten"] = "victim"
    edited = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    assert refusal(verifier, f"{prefix}.{edited}.{signature}") == FORGED
    # a flipped signature bit
    raw = bytearray(base64.urlsafe_b64decode(signature + "=="))
    raw[0] ^= 1
    flipped = base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()
    assert refusal(verifier, f"{prefix}.{payload}.{flipped}") == FORGED
    # a key the nodes do not trust, even when it claims the trusted key's id
    rogue = AssertionSigner(Ed25519PrivateKey.generate(), clock=clock)
    assert refusal(verifier, rogue.sign("acme")) == UNKNOWN_KEY
    rogue.key_id = signer.key_id
    assert refusal(verifier, rogue.sign("acme")) == FORGED
    # the positive control: the untouched original still verifies
    assert verifier.verify(genuine).tenant == "acme"


def test_expiry_issue_time_and_lifetime(
    signer: AssertionSigner, verifier: AssertionVerifier, clock: ManualClock
) -> None:
    assertion = signer.sign("acme", ttl=60)
    clock.now = NOW + 59
    assert verifier.verify(assertion).tenant == "acme"
    clock.now = NOW + 60
    assert refusal(verifier, assertion) == EXPIRED
    clock.now = NOW - 120  # the gateway's clock far ahead of the node's
    assert refusal(verifier, assertion) == NOT_YET_VALID
    clock.now = NOW
    assert refusal(verifier, signer.sign("acme", ttl=3600)) == TOO_LONG_LIVED


def test_audience_binds_an_assertion_to_its_deployment(
    signer: AssertionSigner, clock: ManualClock
) -> None:
    pem = public_key_pem(signer.public_key)
    prod = AssertionVerifier.from_pem([pem], audience="prod", clock=clock)
    unbound = AssertionVerifier.from_pem([pem], clock=clock)
    assert prod.verify(signer.sign("acme", audience="prod")).audience == "prod"
    assert refusal(prod, signer.sign("acme", audience="staging")) == WRONG_AUDIENCE
    assert refusal(prod, signer.sign("acme")) == WRONG_AUDIENCE
    assert refusal(unbound, signer.sign("acme", audience="prod")) == WRONG_AUDIENCE


def test_rotation_accepts_every_configured_key(clock: ManualClock) -> None:
    old = AssertionSigner(Ed25519PrivateKey.generate(), clock=clock)
    new_key = Ed25519PrivateKey.generate()
    pem = new_key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    new = AssertionSigner(pem, clock=clock)  # a gateway configured with a PEM file's bytes
    both = AssertionVerifier([old.public_key, new.public_key], clock=clock)
    assert both.verify(old.sign("a")).tenant == "a"
    assert both.verify(new.sign("b")).tenant == "b"


def test_signer_and_verifier_refuse_bad_configuration(signer: AssertionSigner) -> None:
    with pytest.raises(InvalidRequestError):
        signer.sign("")
    with pytest.raises(InvalidRequestError):
        signer.sign("acme", ttl=0)
    with pytest.raises(InvalidRequestError):
        AssertionVerifier([])
    with pytest.raises(InvalidRequestError):
        AssertionVerifier.from_pem(["not a key"])


# ---- the identity rule over a real cache ---------------------------------------------------


def _engine(kv: tenantkv.TenantKV, verifier: AssertionVerifier) -> EngineNamespaces:
    return EngineNamespaces(kv, verifier, model="tiny", layout=MHA_SMALL, block_tokens=32)


def test_identity_rule_isolates_tenants_and_scopes(
    tmp_path: Path, index: object, signer: AssertionSigner, verifier: AssertionVerifier
) -> None:
    tokens = random_tokens(96)
    with tenantkv.open(tmp_path / "cache", durable=False) as kv:
        kv.create_tenant("acme")
        kv.create_tenant("globex")
        engine = _engine(kv, verifier)

        def cached(assertion: str | None, **client: object) -> int | None:
            """What a request with this assertion (and client-chosen extras) would hit."""
            found = engine.resolve({ASSERTION_PARAM: assertion, **client}, request_id="r")
            return None if found is None else found[1].cached_length(tokens)

        owner = engine.resolve({ASSERTION_PARAM: signer.sign("acme", scope="u1")})
        acme_now = kv.get_tenant("acme").incarnation  # owners are bound to the tenant now
        assert owner is not None and owner[0] == RequestTenant("acme", "u1", acme_now)
        assert owner[1].store(tokens, random_layers(MHA_SMALL, 96)) == 96
        # positive control: the owner's next request hits, a client salt changes nothing
        assert cached(signer.sign("acme", scope="u1")) == 96
        assert cached(signer.sign("acme", scope="u1"), cache_salt="globex") == 96
        # another tenant, another scope of the same tenant, no scope: all miss
        assert cached(signer.sign("globex", scope="u1")) == 0
        assert cached(signer.sign("acme", scope="u2")) == 0
        assert cached(signer.sign("acme")) == 0
        # a client that names the owner in its salt but has no assertion gets no cache at all
        refused_before = kv.security_events().get(ASSERTION_REFUSED, 0)
        assert cached(None, cache_salt="acme") is None
        assert kv.security_events()[ASSERTION_REFUSED] == refused_before + 1
        # a tenant the gateway vouches for but the cache does not know: a miss, no cache
        assert cached(signer.sign("initech")) is None
        # namespaces' keys are tenantkv's keyed hashes: same tokens, unrelated keys
        acme = engine.namespace(RequestTenant("acme", "u1"))
        globex = engine.namespace(RequestTenant("globex", "u1"))
        assert acme is not None and globex is not None
        assert set(acme._keys(tokens)).isdisjoint(globex._keys(tokens))


def test_refused_assertions_are_security_events(
    tmp_path: Path, index: object, signer: AssertionSigner, clock: ManualClock
) -> None:
    verifier = AssertionVerifier([signer.public_key], clock=clock)
    rogue = AssertionSigner(Ed25519PrivateKey.generate(), clock=clock)
    with tenantkv.open(tmp_path / "cache", durable=False) as kv:
        kv.create_tenant("acme")
        engine = _engine(kv, verifier)
        expired = signer.sign("acme", ttl=10)
        clock.now = NOW + 11
        refused = [None, "tkva1.junk", rogue.sign("acme"), expired]
        for assertion in refused:
            assert engine.resolve({ASSERTION_PARAM: assertion}, request_id="req-1") is None
        assert engine.resolve(None) is None  # no kv_transfer_params at all
        assert kv.security_events()[ASSERTION_REFUSED] == len(refused) + 1
        details = [e.detail for e in kv.recent_security_events() if e.kind == ASSERTION_REFUSED]
        assert any("expired" in d for d in details) and any("unknown_key" in d for d in details)
        # the events are not filed under the tenant the rogue assertion claims
        assert all(e.tenant == "" for e in kv.recent_security_events())
        # positive control: a fresh genuine assertion resolves
        assert engine.resolve({ASSERTION_PARAM: signer.sign("acme")}) is not None
        assert kv.security_events()[ASSERTION_REFUSED] == len(refused) + 1


def test_deleted_tenant_namespaces_are_dropped(
    tmp_path: Path, index: object, signer: AssertionSigner, verifier: AssertionVerifier
) -> None:
    tokens = random_tokens(64)
    with tenantkv.open(tmp_path / "cache", durable=False) as kv:
        kv.create_tenant("acme")
        engine = _engine(kv, verifier)
        owner = RequestTenant("acme", None)
        first = engine.namespace(owner)
        assert first is not None and first.store(tokens, random_layers(MHA_SMALL, 64)) == 64
        assert engine.namespace(owner) is first  # kept while nothing changes
        kv.delete_tenant("acme")
        assert engine.namespace(owner) is None  # gone with the tenant, not served from memory
        kv.create_tenant("acme")  # a new tenant of the same name: its own, empty namespace
        second = engine.namespace(owner)
        assert second is not None and second is not first
        assert second.cached_length(tokens) == 0
