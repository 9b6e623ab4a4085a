"""Tenant assertions are bound to the tenant's incarnation: an assertion issued to a tenant that
was deleted does not open the cache of the next tenant created under the same name, within the
assertion's lifetime, within the clock skew, or on the worker side after the scheduler side's
check. Each refusal has its positive control: the new tenant's own fresh assertion hits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient

import tenantkv
from tenantkv.errors import InvalidRequestError, TenantAssertionError
from tenantkv.integrations.engine_identity import (
    ASSERTION_PARAM,
    ASSERTION_REFUSED,
    EngineNamespaces,
)
from tenantkv.server.app import create_app
from tenantkv.server.settings import Settings
from tenantkv.tenant_assertion import (
    DEFAULT_CLOCK_SKEW,
    NO_INCARNATION,
    STALE_INCARNATION,
    AssertionSigner,
    AssertionVerifier,
    TenantAssertion,
)
from tests.helpers import MHA_SMALL, ManualClock, random_layers, random_tokens
from tests.test_server import finished_job

NOW = 1_800_000_000.0
TOKENS = random_tokens(96)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(NOW)


@pytest.fixture
def signer(clock: ManualClock) -> AssertionSigner:
    return AssertionSigner(Ed25519PrivateKey.generate(), clock=clock)


@pytest.fixture
def kv(tmp_path: Path, index: object, clock: ManualClock) -> Iterator[tenantkv.TenantKV]:
    """A cache on the same clock as the gateway (tenants' creation times are the node's)."""
    with tenantkv.open(tmp_path / "cache", durable=False, clock=clock) as cache:
        yield cache


def _engine(kv: tenantkv.TenantKV, verifier: AssertionVerifier) -> EngineNamespaces:
    return EngineNamespaces(kv, verifier, model="tiny", layout=MHA_SMALL, block_tokens=32)


def _cached(engine: EngineNamespaces, assertion: str) -> int | None:
    """What a request carrying ``assertion`` would hit (None: no cache at all)."""
    found = engine.resolve({ASSERTION_PARAM: assertion}, request_id="r")
    return None if found is None else found[1].cached_length(TOKENS)


def _store(engine: EngineNamespaces, assertion: str) -> None:
    found = engine.resolve({ASSERTION_PARAM: assertion}, request_id="w")
    assert found is not None
    assert found[1].store(TOKENS, random_layers(MHA_SMALL, 96)) == 96


def _refusal(engine: EngineNamespaces, verifier: AssertionVerifier, assertion: str) -> str:
    """The reason the engine refuses ``assertion`` for: verified (signature, expiry, ...) it
    is, so the refusal is about the tenant it names."""
    claims = verifier.verify(assertion)
    with pytest.raises(TenantAssertionError) as caught:
        engine.owner_of(claims)
    return caught.value.reason


def test_assertion_of_a_deleted_tenant_does_not_open_the_next_one(
    kv: tenantkv.TenantKV, signer: AssertionSigner, clock: ManualClock
) -> None:
    """An assertion without ``inc`` (what every gateway sent before it existed), issued to
    the first acme and still unexpired, does not reach the second acme's cache."""
    verifier = AssertionVerifier([signer.public_key], clock=clock)
    engine = _engine(kv, verifier)
    kv.create_tenant("acme")
    old = signer.sign("acme", ttl=300)
    _store(engine, old)
    assert _cached(engine, old) == 96
    clock.advance(60)  # beyond the skew, well within the old assertion's lifetime
    kv.delete_tenant("acme")
    kv.create_tenant("acme")
    fresh = signer.sign("acme", ttl=300)
    _store(engine, fresh)  # the new acme caches the same prompt
    refused_before = kv.security_events().get(ASSERTION_REFUSED, 0)
    assert _cached(engine, old) is None
    assert kv.security_events().get(ASSERTION_REFUSED, 0) == refused_before + 1
    assert _refusal(engine, verifier, old) == STALE_INCARNATION
    # positive control: the new acme's own assertion hits what it stored
    assert _cached(engine, fresh) == 96


def test_recreation_within_the_clock_skew_is_told_apart_by_the_incarnation(
    kv: tenantkv.TenantKV, signer: AssertionSigner, clock: ManualClock
) -> None:
    """Deleted and re-created 5 s later (within the 30 s skew, so the creation time cannot
    tell): an assertion carrying the first acme's incarnation is refused; a verifier that
    requires the incarnation refuses one without it."""
    verifier = AssertionVerifier([signer.public_key], clock=clock)
    strict = AssertionVerifier([signer.public_key], clock=clock, require_incarnation=True)
    engine, strict_engine = _engine(kv, verifier), _engine(kv, strict)
    first = kv.create_tenant("acme").incarnation
    old = signer.sign("acme", ttl=300, incarnation=first)
    unbound = signer.sign("acme", ttl=300)
    _store(engine, old)
    clock.advance(5)
    assert clock.now - NOW < DEFAULT_CLOCK_SKEW
    kv.delete_tenant("acme")
    second = kv.create_tenant("acme").incarnation
    assert second != first and kv.get_tenant("acme").incarnation == second
    fresh = signer.sign("acme", ttl=300, incarnation=second)
    _store(engine, fresh)
    assert _cached(engine, old) is None
    assert _refusal(engine, verifier, old) == STALE_INCARNATION
    assert _cached(strict_engine, unbound) is None
    with pytest.raises(TenantAssertionError) as caught:
        strict.verify(unbound)
    assert caught.value.reason == NO_INCARNATION
    # positive controls: the second acme's bound assertion hits, with either verifier
    assert _cached(engine, fresh) == 96
    assert _cached(strict_engine, fresh) == 96


def test_an_owner_checked_before_the_deletion_gets_no_namespace_of_the_next_tenant(
    kv: tenantkv.TenantKV, signer: AssertionSigner, clock: ManualClock
) -> None:
    """vLLM's worker side opens the namespace of the owner its scheduler side checked, later:
    by then the tenant may have been deleted and re-created. It gets no namespace."""
    engine = _engine(kv, AssertionVerifier([signer.public_key], clock=clock))
    kv.create_tenant("acme")
    checked = engine.identify({ASSERTION_PARAM: signer.sign("acme")}, request_id="r")
    assert checked is not None
    clock.advance(1)
    kv.delete_tenant("acme")
    kv.create_tenant("acme")
    _store(engine, signer.sign("acme"))
    assert engine.namespace(checked) is None
    # positive control: an owner checked against the second acme gets its namespace and hit
    now_checked = engine.identify({ASSERTION_PARAM: signer.sign("acme")}, request_id="r")
    assert now_checked is not None and now_checked.incarnation != checked.incarnation
    namespace = engine.namespace(now_checked)
    assert namespace is not None and namespace.cached_length(TOKENS) == 96


def test_the_creation_check_allows_the_skew_and_no_more(
    signer: AssertionSigner, clock: ManualClock
) -> None:
    """The verifier's incarnation check alone (no cache): where its boundaries are."""
    verifier = AssertionVerifier([signer.public_key], clock=clock, clock_skew=10)
    incarnation = "ab" * 16

    def claims(issued_at: int, inc: str | None = None) -> TenantAssertion:
        return TenantAssertion("acme", None, None, issued_at, issued_at + 60, "k", inc)

    created = NOW + 0.5  # created mid-second: whole-second issue times round down
    verifier.check_incarnation(claims(int(NOW) - 10), incarnation=incarnation, created_at=created)
    verifier.check_incarnation(
        claims(int(NOW), incarnation), incarnation=incarnation, created_at=created
    )
    for refused in (claims(int(NOW) - 11), claims(int(NOW) + 5, "cd" * 16)):
        with pytest.raises(TenantAssertionError) as caught:
            verifier.check_incarnation(refused, incarnation=incarnation, created_at=created)
        assert caught.value.reason == STALE_INCARNATION


def test_the_signer_refuses_a_malformed_incarnation(signer: AssertionSigner) -> None:
    for bad in ("", "acme", "AB" * 16, "ab" * 15, "ab" * 17, "zz" * 16):
        with pytest.raises(InvalidRequestError):
            signer.sign("acme", incarnation=bad)
    assert signer.sign("acme", incarnation="0f" * 16).startswith("tkva1.")


def test_the_gateway_learns_the_incarnation_from_the_admin_api(
    kv: tenantkv.TenantKV, signer: AssertionSigner, clock: ManualClock
) -> None:
    """What a gateway does: read ``incarnation`` from the admin API, sign it in; after the
    tenant is re-created the API answers a new one, and only assertions carrying it hit."""
    operator = kv.tokens.ensure_first_operator()
    assert operator is not None
    headers = {"Authorization": f"Bearer {operator}"}
    engine = _engine(kv, AssertionVerifier([signer.public_key], clock=clock))
    with TestClient(create_app(kv, Settings(root=str(kv.config.root)))) as client:
        first = client.post("/v1/tenants", json={"name": "acme"}, headers=headers).json()
        assert first["incarnation"] == kv.get_tenant("acme").incarnation
        old = signer.sign("acme", incarnation=first["incarnation"])
        deleted = client.delete("/v1/tenants/acme", headers=headers)
        assert finished_job(client, deleted, headers)["state"] == "succeeded"
        client.post("/v1/tenants", json={"name": "acme"}, headers=headers)
        second = client.get("/v1/tenants/acme", headers=headers).json()["incarnation"]
    assert second != first["incarnation"] and len(second) == 32
    fresh = signer.sign("acme", incarnation=second)
    _store(engine, fresh)
    assert _cached(engine, old) is None
    assert _cached(engine, fresh) == 96  # positive control
