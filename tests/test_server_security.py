"""Security properties of the admin API: no cross-tenant access and no existence oracle,
refusals audited, revoked and expired tokens refused, tokens stored hashed, and a bounded
schemathesis run per role (no 5xx, no other tenant's name in any answer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")

from tenantkv.server.auth import create_token, hash_token
from tests.indexes import Index
from tests.test_server import Api, api_fixture, audit_records, bearer  # noqa: F401

# (method, path template, json body) of every tenant-scoped endpoint a tenant-admin may use.
TENANT_ENDPOINTS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/v1/tenants/{t}", None),
    ("PATCH", "/v1/tenants/{t}", {"retention": {"agent": "2d"}}),
    ("POST", "/v1/tenants/{t}/keys/rotate", None),
    ("POST", "/v1/tenants/{t}/keys/retire", None),
    ("GET", "/v1/tenants/{t}/usage", None),
    ("POST", "/v1/tenants/{t}/purge", {"scope": "s"}),
    ("POST", "/v1/tenants/{t}/tokens", {"ttl_seconds": 60}),
    ("GET", "/v1/tenants/{t}/tokens", None),
    ("DELETE", "/v1/tenants/{t}/tokens/0123456789abcdef", None),
    ("GET", "/v1/audit/export?tenant={t}", None),
    ("GET", "/v1/audit/checkpoints?tenant={t}", None),
]
OPERATOR_ONLY = [("DELETE", "/v1/tenants/{t}", None)]
NOT_FOUND = {"error": "not_found", "detail": "no such tenant"}


def _call(api: Api, method: str, path: str, body: Any, headers: dict[str, str]) -> Any:
    return api.client.request(method, path, json=body, headers={**headers, "X-Request-ID": "r1"})


@pytest.mark.parametrize(("method", "path", "body"), TENANT_ENDPOINTS + OPERATOR_ONLY)
def test_cross_tenant_access_is_a_plain_404(
    api: Api, method: str, path: str, body: dict[str, Any] | None
) -> None:
    own = _call(api, method, path.format(t="acme"), body, api.acme)
    if (method, path, body) in OPERATOR_ONLY:
        assert own.status_code == 403  # positive control: the route answers, the role may not
    elif path.endswith("0123456789abcdef"):
        assert own.status_code == 404 and own.json()["detail"] == "no such token"
    else:
        assert own.status_code in (200, 201), own.text  # the owner succeeds
    other = _call(api, method, path.format(t="globex"), body, api.acme)
    missing = _call(api, method, path.format(t="no-such-tenant"), body, api.acme)
    assert other.status_code == missing.status_code == 404
    assert other.json() == missing.json() == NOT_FOUND
    assert other.content == missing.content
    assert dict(other.headers) == dict(missing.headers)
    # the operator's answer about a missing tenant is the same 404 too
    if "audit" not in path:
        by_operator = _call(api, method, path.format(t="no-such-tenant"), body, api.operator)
        assert by_operator.json() == NOT_FOUND
    assert api.kv.get_tenant("globex").key_version == 1  # nothing happened to globex


def test_refusals_are_audited_without_revealing_existence(api: Api) -> None:
    api.client.get("/v1/tenants/globex", headers=api.acme)
    api.client.get("/v1/tenants/no-such-tenant", headers=api.acme)
    api.client.get("/v1/tenants", headers={"Authorization": "Bearer tkv_" + "x" * 43})
    api.client.get("/v1/tenants/acme", headers=api.auditor)
    api.client.app.state.refusals.flush()  # 401s are audited per source and time window
    refused = [r for r in audit_records(api.kv, "acme") if r["action"] == "access.refused"]
    assert [r["details"] for r in refused] == [  # type: ignore[index]
        {"reason": "other-tenant", "method": "GET"},
        {"reason": "other-tenant", "method": "GET"},
    ]
    assert refused[0]["target"] == refused[1]["target"] == "/v1/tenants/{name}"
    assert all(r["outcome"] == "denied" for r in refused)
    assert not [r for r in audit_records(api.kv, "globex") if r["action"] == "access.refused"]
    system = [
        r
        for r in audit_records(api.kv, None)
        if r["action"] == "access.refused" and r["chain"] == "system"
    ]
    details: list[dict[str, Any]] = [r["details"] for r in system]  # type: ignore[misc]
    assert [d["reason"] for d in details if "reason" in d] == ["role"]
    assert [d["reasons"] for d in details if "reasons" in d] == [{"unknown": 1}]


def test_revoked_and_expired_tokens_are_refused(api: Api) -> None:
    short = create_token(api.kv, "tenant-admin", "acme", ttl_seconds=60)
    assert api.client.get("/v1/tenants/acme", headers=bearer(short)).status_code == 200
    api.clock.now += 61
    expired = api.client.get("/v1/tenants/acme", headers=bearer(short))
    assert expired.status_code == 401 and expired.headers["www-authenticate"] == "Bearer"
    made = api.client.post("/v1/tenants/acme/tokens", headers=api.acme).json()
    assert (
        api.client.delete(f"/v1/tokens/{made['token_id']}", headers=api.operator).status_code == 204
    )
    revoked = api.client.get("/v1/tenants/acme", headers=bearer(made["token"]))
    assert revoked.status_code == 401 and revoked.json() == expired.json()
    for header in ("", "Bearer", "Basic Zm9vOmJhcg==", "Bearer tkv_short", "Bearer \u00e9"):
        headers = {"Authorization": header} if header.isascii() else {}
        assert api.client.get("/v1/tenants", headers=headers).status_code == 401


def test_tenant_admin_cannot_mint_past_its_own_expiry(api: Api) -> None:
    short = bearer(create_token(api.kv, "tenant-admin", "acme", ttl_seconds=100))
    made = api.client.post("/v1/tenants/acme/tokens", json={"ttl_seconds": 5000}, headers=short)
    assert made.status_code == 201
    assert made.json()["expires_at"] <= api.clock.now + 100


def test_tokens_are_stored_hashed_only(api: Api, tmp_path: Path, index: Index) -> None:
    made = api.client.post("/v1/tokens", json={"role": "auditor"}, headers=api.operator).json()
    api.kv.context.index.scrub_log()
    raw = made["token"].encode()
    secret = raw.removeprefix(b"tkv_")
    for path in (tmp_path / "cache").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert raw not in data and secret not in data, path
    stored = index.stored_bytes(
        api.kv.context.index.url
    )  # the index's files, or its rows on PostgreSQL
    assert hash_token(made["token"]).encode() in stored  # positive control: the scan sees it
    assert raw not in stored and secret not in stored
    for header in (api.operator, api.acme, api.auditor):
        token = header["Authorization"].removeprefix("Bearer ").encode()
        assert token not in stored


# ---- schemathesis ------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["operator", "tenant-admin", "auditor", "none"])
def test_schemathesis_no_5xx_and_no_leak(api: Api, role: str) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    headers = {
        "operator": api.operator,
        "tenant-admin": api.acme,
        "auditor": api.auditor,
        "none": {},
    }[role]
    api.kv.create_tenant("zz-hidden-tenant")
    schema = schemathesis.openapi.from_asgi("/openapi.json", api.client.app)

    @settings(
        max_examples=100,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=schema.as_strategy())
    def check(case: Any) -> None:
        response = case.call(headers=headers)
        assert response.status_code < 500, (case.method, case.path, response.text)
        if role != "operator" and role != "auditor":
            assert "zz-hidden-tenant" not in response.text
            assert "globex" not in response.text

    check()
    # the fuzzing did not disturb the tenants it was not allowed to touch
    if role != "operator":
        assert {t.name for t in api.kv.list_tenants()} >= {"acme", "globex", "zz-hidden-tenant"}
