"""The gateway with the cache's real inference keys (``kv.inference_keys``), as ``tenantkv
gateway`` builds it, in front of a recording backend on loopback: a minted key reaches the
backend as its tenant, scope and current incarnation (the assertion verifies, the salt is the
identity's); a revoked key, a key of a deleted tenant and a key of a tenant's predecessor are
401 and send nothing upstream; an index that fails the lookup is a 503, not a 401 or a 500. Each
refusal has its positive control."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from sqlalchemy import text

import tenantkv
from tenantkv import TenantKV
from tenantkv.cli.gateway import GatewayOptions, _authenticator, build_gateway
from tenantkv.gateway import GatewayIdentity, GatewaySettings
from tenantkv.gateway.keyed import cache_salt
from tenantkv.integrations.engine_identity import ASSERTION_PARAM
from tenantkv.tenant_assertion import AssertionVerifier
from tests.indexes import Index

from .gateway_stack import Recording, recording_backend, serving

AUD = "deployment-1"
SECRET = b"s" * 32
SIGNING = Ed25519PrivateKey.generate()


@pytest.fixture(name="kv")
def kv_fixture(tmp_path: Path, index: Index) -> Iterator[TenantKV]:
    with tenantkv.open(tmp_path / "cache", durable=False) as kv:
        kv.create_tenant("acme")
        kv.create_tenant("globex")
        yield kv


@pytest.fixture(name="gateway")
def gateway_fixture(kv: TenantKV, tmp_path: Path) -> Iterator[tuple[httpx.Client, Recording]]:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    pem = tmp_path / "gateway.pem"
    pem.write_bytes(SIGNING.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    rec = Recording("b0")
    with serving(recording_backend(rec)) as backend:
        options = GatewayOptions(
            root=str(tmp_path / "cache"),
            backends=(backend,),
            secret_file=secret,
            signing_key_file=pem,
            settings=GatewaySettings(audience=AUD),
        )
        app = build_gateway(kv, options, _authenticator)
        with serving(app) as url, httpx.Client(base_url=url, timeout=10) as client:
            yield client, rec


def call(client: httpx.Client, key: str, **body: Any) -> httpx.Response:
    return client.post(
        "/v1/completions",
        json={"model": "m", "prompt": "hello", **body},
        headers={"Authorization": f"Bearer {key}"},
    )


def verified(rec: Recording) -> Any:
    params = rec.requests[-1]["body"]["kv_transfer_params"]
    verifier = AssertionVerifier([SIGNING.public_key()], audience=AUD)
    return verifier.verify(params[ASSERTION_PARAM])


def test_a_minted_key_reaches_the_backend_as_its_tenant_scope_and_incarnation(
    kv: TenantKV, gateway: tuple[httpx.Client, Recording]
) -> None:
    client, rec = gateway
    info, key = kv.inference_keys.create("acme", "app", scope="alice")
    answer = call(client, key, cache_salt="client-chosen")
    assert answer.status_code == 200, answer.text
    claims = verified(rec)
    incarnation = kv.tenant_incarnation("acme")
    assert incarnation is not None
    assert (claims.tenant, claims.scope) == ("acme", "alice")
    assert claims.incarnation == incarnation.incarnation
    identity = GatewayIdentity(info.id, "acme", "alice", incarnation.incarnation)
    assert rec.requests[-1]["body"]["cache_salt"] == cache_salt(SECRET, identity)


def test_revoked_deleted_and_predecessor_keys_are_401_and_send_nothing(
    kv: TenantKV, gateway: tuple[httpx.Client, Recording]
) -> None:
    client, rec = gateway
    revoked_info, revoked = kv.inference_keys.create("globex", "old")
    _, kept = kv.inference_keys.create("globex", "kept")
    _, predecessor = kv.inference_keys.create("acme", "app")
    assert call(client, revoked).status_code == 200  # control: each works before
    assert call(client, predecessor).status_code == 200
    sent = len(rec.requests)

    assert kv.inference_keys.revoke("globex", revoked_info.id)
    kv.delete_tenant("acme")
    kv.create_tenant("acme")  # the next tenant of the name
    for key in (revoked, predecessor, "tkvi_" + "x" * 43):
        answer = call(client, key)
        assert answer.status_code == 401, answer.text
    assert len(rec.requests) == sent  # nothing went upstream

    # Controls: a key of the same tenant still works, and a key of the new acme works as
    # the new incarnation.
    assert call(client, kept).status_code == 200
    _, fresh = kv.inference_keys.create("acme", "app")
    assert call(client, fresh).status_code == 200
    current = kv.tenant_incarnation("acme")
    assert current is not None and verified(rec).incarnation == current.incarnation


def test_a_key_service_that_cannot_answer_is_503(
    kv: TenantKV, gateway: tuple[httpx.Client, Recording]
) -> None:
    client, rec = gateway
    _, key = kv.inference_keys.create("acme", "app")
    assert call(client, key).status_code == 200  # control
    sent = len(rec.requests)
    rename(kv, "tkv_inference_keys", "tkv_inference_keys_gone")  # the index fails the lookup
    try:
        answer = call(client, key)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["type"] == "unavailable"
        assert len(rec.requests) == sent
    finally:
        rename(kv, "tkv_inference_keys_gone", "tkv_inference_keys")
    assert call(client, key).status_code == 200  # and serves again once it answers


def rename(kv: TenantKV, table: str, to: str) -> None:
    with kv.context.index.write() as session:
        session.execute(text(f"ALTER TABLE {table} RENAME TO {to}"))
