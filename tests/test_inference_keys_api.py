"""Inference keys through the admin API (``/v1/tenants/{name}/inference-keys``): operators and
the tenant's own tenant-admins mint, list and revoke; another tenant's admin gets the same 404
as for a tenant that does not exist and changes nothing; an inference key is no bearer token of
the admin API."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")

from tenantkv.services.inference_keys import key_id_of
from tests.test_server import Api, api_fixture, audit_records, bearer  # noqa: F401

ROUTE = "/v1/tenants/{t}/inference-keys"
NOT_FOUND = {"error": "not_found", "detail": "no such tenant"}


def _mint(api: Api, tenant: str, headers: dict[str, str], **body: Any) -> Any:
    return api.client.post(ROUTE.format(t=tenant), json={"name": "app", **body}, headers=headers)


def test_a_tenant_admin_manages_its_own_tenants_keys(api: Api) -> None:
    made = _mint(api, "acme", api.acme, scope="team-a", expires_in=600)
    assert made.status_code == 201, made.text
    body = made.json()
    assert body["key"].startswith("tkvi_") and body["id"] == key_id_of(body["key"])
    assert (body["tenant"], body["scope"], body["uses"]) == ("acme", "team-a", 0)
    assert body["expires_at"] == pytest.approx(api.kv.now() + 600)
    identity = api.kv.inference_keys.authenticate(body["key"])
    assert identity is not None and (identity.tenant, identity.scope) == ("acme", "team-a")

    listed = api.client.get(ROUTE.format(t="acme"), headers=api.acme)
    assert listed.status_code == 200
    assert [k["id"] for k in listed.json()] == [body["id"]]
    assert body["key"] not in listed.text and "key_hash" not in listed.text
    assert listed.json()[0]["uses"] == 1  # the authentication above, counted

    gone = api.client.delete(f"{ROUTE.format(t='acme')}/{body['id']}", headers=api.acme)
    assert gone.status_code == 204
    assert api.kv.inference_keys.authenticate(body["key"]) is None
    again = api.client.delete(f"{ROUTE.format(t='acme')}/{body['id']}", headers=api.acme)
    assert again.status_code == 204  # revoking a revoked key: it exists, nothing changes
    missing = api.client.delete(f"{ROUTE.format(t='acme')}/0123456789abcdef", headers=api.acme)
    assert missing.status_code == 404
    assert missing.json() == {"error": "not_found", "detail": "no such inference key"}
    actions = [r["action"] for r in audit_records(api.kv, "acme")]
    assert "inference_key.create" in actions and "inference_key.revoke" in actions


def test_a_tenant_admin_cannot_touch_another_tenants_keys(api: Api) -> None:
    theirs = _mint(api, "globex", api.globex)
    assert theirs.status_code == 201  # control: globex's own admin may
    key, key_id = theirs.json()["key"], theirs.json()["id"]
    for method, path, body in [
        ("POST", ROUTE.format(t="globex"), {"name": "mine"}),
        ("GET", ROUTE.format(t="globex"), None),
        ("DELETE", f"{ROUTE.format(t='globex')}/{key_id}", None),
    ]:
        other = api.client.request(method, path, json=body, headers=api.acme)
        missing = api.client.request(
            method, path.replace("globex", "no-such-tenant"), json=body, headers=api.acme
        )
        assert other.status_code == missing.status_code == 404
        assert other.json() == missing.json() == NOT_FOUND
    # acme's admin naming globex's key under its own tenant reaches nothing either
    own_route = api.client.delete(f"{ROUTE.format(t='acme')}/{key_id}", headers=api.acme)
    assert own_route.status_code == 404
    assert api.kv.inference_keys.authenticate(key) is not None  # untouched
    assert [k.id for k in api.kv.inference_keys.list("globex")] == [key_id]  # none added
    # an operator reaches every tenant
    by_operator = api.client.delete(f"{ROUTE.format(t='globex')}/{key_id}", headers=api.operator)
    assert by_operator.status_code == 204
    assert api.kv.inference_keys.authenticate(key) is None


def test_auditors_and_anonymous_callers_cannot_mint(api: Api) -> None:
    assert _mint(api, "acme", api.auditor).status_code == 403
    assert _mint(api, "acme", {}).status_code == 401
    assert api.kv.inference_keys.list("acme") == []
    assert _mint(api, "acme", api.operator).status_code == 201  # control


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"name": ""},
        {"name": "a b"},
        {"name": "app", "scope": ""},
        {"name": "app", "expires_in": 0},
        {"name": "app", "expires_in": 367 * 86400},
        {"name": "app", "extra": 1},
    ],
)
def test_bad_bodies_are_422_and_mint_nothing(api: Api, body: dict[str, Any]) -> None:
    answer = api.client.post(ROUTE.format(t="acme"), json=body, headers=api.operator)
    assert answer.status_code == 422, answer.text
    assert api.kv.inference_keys.list("acme") == []


def test_an_inference_key_is_no_admin_bearer_token(api: Api) -> None:
    key = _mint(api, "acme", api.operator).json()["key"]
    assert api.client.get("/v1/tenants/acme", headers=api.acme).status_code == 200  # control
    assert api.client.get("/v1/tenants/acme", headers=bearer(key)).status_code == 401
    assert api.client.get(ROUTE.format(t="acme"), headers=bearer(key)).status_code == 401
