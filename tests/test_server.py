"""The admin API, endpoint by endpoint and role by role (FastAPI TestClient), plus one run
against a real uvicorn server on a loopback port."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import inspect, text

import tenantkv
from tenantkv import SchemaVersionError, TenantKV
from tenantkv.audit import chain_for, verify_export
from tenantkv.cli import main
from tenantkv.components.health import INCOMPLETE_SCRUBS, SCRUB_PENDING
from tenantkv.index import tenants as tenant_rows
from tenantkv.server.app import create_app
from tenantkv.server.settings import Settings
from tenantkv.services.tokens import AuthError, hash_token, token_id_of
from tests.helpers import MLA_SMALL, ManualClock, random_layers, random_tokens
from tests.indexes import Index
from tests.ports import free_port


@dataclass
class Api:
    kv: TenantKV
    client: TestClient
    clock: ManualClock
    operator: dict[str, str]
    auditor: dict[str, str]
    acme: dict[str, str]  # tenant-admin of acme
    globex: dict[str, str]  # tenant-admin of globex


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(name="api")
def api_fixture(tmp_path: Path, index: Index) -> Iterator[Api]:
    clock = ManualClock(time.time())
    kv = tenantkv.open(tmp_path / "cache", durable=False, capacity_bytes=2**50, clock=clock)
    try:
        app = create_app(kv, Settings(root=str(tmp_path / "cache")))
        operator = kv.tokens.ensure_first_operator()
        assert operator is not None
        kv.create_tenant("acme")
        kv.create_tenant("globex")
        with TestClient(app) as client:
            yield Api(
                kv=kv,
                client=client,
                clock=clock,
                operator=bearer(operator),
                auditor=bearer(kv.tokens.create("auditor")),
                acme=bearer(kv.tokens.create("tenant-admin", "acme")),
                globex=bearer(kv.tokens.create("tenant-admin", "globex")),
            )
    finally:
        kv.close()


def finished_job(
    client: TestClient, started: httpx.Response, headers: dict[str, str]
) -> dict[str, Any]:
    """The job a 202 answer started, polled at its ``Location`` until it ends."""
    assert started.status_code == 202, started.text
    location = started.headers["Location"]
    assert location == f"/v1/jobs/{started.json()['id']}"
    deadline = time.monotonic() + 60
    while True:
        job = client.get(location, headers=headers).json()
        if job["state"] in ("succeeded", "failed", "interrupted"):
            return dict(job)
        assert time.monotonic() < deadline, f"job still {job['state']}"
        time.sleep(0.01)


def store_some(kv: TenantKV, tenant: str, scope: str | None = None, seed: int = 0) -> list[int]:
    ns = kv.namespace(tenant, model="m", layout=MLA_SMALL, scope=scope)
    tokens = random_tokens(128, seed=seed)
    ns.store(tokens, random_layers(MLA_SMALL, 128, seed=seed))
    assert ns.lookup(tokens) == 128
    return tokens


def tenant_chain(kv: TenantKV, name: str) -> str:
    """The audit chain of the tenant ``name`` as it exists now (its incarnation's)."""
    with kv.context.index.read() as session:
        tenant_id = tenant_rows.id_of(session, name)
    assert tenant_id is not None, f"no tenant {name}"
    return chain_for(name, tenant_id)


def audit_records(kv: TenantKV, tenant: str | None) -> list[dict[str, object]]:
    with kv.context.index.read() as session:
        lines = list(kv.context.audit.export(session, tenant=tenant))
    return [
        r for r in map(json.loads, lines) if r.get("type", "record") == "record" and "action" in r
    ]


# ---- bootstrap and health ----------------------------------------------------------------------


def test_bootstrap_token_only_once(api: Api) -> None:
    assert api.kv.tokens.ensure_first_operator() is None
    assert api.client.get("/v1/tenants", headers=api.operator).status_code == 200


def test_healthz_needs_no_token(api: Api) -> None:
    response = api.client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_metrics_text_format_without_tenant_names(api: Api) -> None:
    api.client.get("/v1/tenants/acme", headers=api.acme)
    assert api.client.get("/metrics").status_code == 401
    assert api.client.get("/metrics", headers=api.acme).status_code == 403
    response = api.client.get("/metrics", headers=api.auditor)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert "tenantkv_tenants 2" in text
    assert 'route="/v1/tenants/{name}",status="2xx"' in text
    assert (
        "acme" not in text and "globex" not in text and "tkv_" not in text.replace("tenantkv_", "")
    )
    assert "tenantkv_scrub_pending 0.0\n" in text
    # what the shredding service records when a reader's snapshot held a scrub back
    api.kv.context.health.count(INCOMPLETE_SCRUBS)
    api.kv.context.health.set(SCRUB_PENDING, 1)
    text = api.client.get("/metrics", headers=api.auditor).text
    assert "tenantkv_scrub_pending 1.0\n" in text
    assert 'tenantkv_health_events_total{kind="incomplete_scrubs"} 1.0\n' in text


def test_metrics_parse_and_include_the_data_plane_without_tenant_names(api: Api) -> None:
    """One registry: the service's counters, the cache's gauges and its data-plane metrics, in
    the format Prometheus's own parser reads."""
    store_some(api.kv, "acme")  # a store and a lookup that hits 128 tokens
    api.client.get("/v1/tenants/acme", headers=api.acme)
    api.client.get("/v1/tenants/acme")  # a 401
    text = api.client.get("/metrics", headers=api.auditor).text
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("tenantkv_hit_tokens_total", ())] == 128
    assert samples[("tenantkv_stored_bytes_total", ())] > 0
    assert samples[("tenantkv_tenants", ())] == 2
    assert samples[("tenantkv_cached_bytes", ())] > 0
    assert ("tenantkv_time_to_first_layer_seconds_count", ()) in samples
    assert samples[("tenantkv_auth_refused_total", (("reason", "missing"),))] >= 1
    route = (("method", "GET"), ("route", "/v1/tenants/{name}"), ("status", "2xx"))
    assert samples[("tenantkv_http_requests_total", route)] == 1
    assert all("acme" not in str(labels) and "globex" not in str(labels) for _, labels in samples)


# ---- tenants -----------------------------------------------------------------------------------


def test_create_list_get_update_delete(api: Api) -> None:
    c = api.client
    created = c.post(
        "/v1/tenants",
        json={"name": "initech", "quota_bytes": 2**20, "retention": {"agent": "1d"}},
        headers=api.operator,
    )
    assert created.status_code == 201, created.text
    assert created.json()["quota_bytes"] == 2**20
    assert created.json()["retention"]["agent"] == 86400.0
    assert c.post("/v1/tenants", json={"name": "initech"}, headers=api.operator).status_code == 409
    names = [t["name"] for t in c.get("/v1/tenants", headers=api.operator).json()]
    assert names == ["acme", "globex", "initech"]
    assert c.get("/v1/tenants/initech", headers=api.operator).json()["name"] == "initech"
    updated = c.patch(
        "/v1/tenants/initech",
        json={"quota_bytes": 2**21, "retention": {"chat": "2h"}},
        headers=api.operator,
    )
    assert updated.status_code == 200
    assert updated.json()["quota_bytes"] == 2**21 and updated.json()["retention"]["chat"] == 7200
    deleted = c.delete("/v1/tenants/initech", headers=api.operator)
    assert finished_job(c, deleted, api.operator)["state"] == "succeeded"
    assert c.get("/v1/tenants/initech", headers=api.operator).status_code == 404
    assert c.delete("/v1/tenants/initech", headers=api.operator).status_code == 404


def test_delete_crypto_shreds_and_revokes_tenant_tokens(api: Api) -> None:
    store_some(api.kv, "acme")
    assert api.client.get("/v1/tenants/acme", headers=api.acme).status_code == 200
    deleted = api.client.delete("/v1/tenants/acme", headers=api.operator)
    job = finished_job(api.client, deleted, api.operator)
    assert job["state"] == "succeeded" and job["result"]["extents_removed"] == 1
    assert api.kv.info()["extents"] == 0
    api.kv.create_tenant("acme")  # the same name again: the old admin token must not carry over
    assert api.client.get("/v1/tenants/acme", headers=api.acme).status_code == 401


def test_validation_errors_are_clear_4xx(api: Api) -> None:
    c = api.client
    for body in (
        {"name": "bad name!"},
        {"name": ""},
        {"name": "x", "quota_bytes": 0},
        {"name": "x", "quota_bytes": 2**70},
        {"name": "x", "retention": {"agent": "forever"}},
        {"name": "x", "retention": {"BAD": "1d"}},
        {"name": "x", "unknown": 1},
        {"name": 5},
    ):
        response = c.post("/v1/tenants", json=body, headers=api.operator)
        assert response.status_code == 422, (body, response.text)
        assert response.json()["error"] == "invalid_request" and response.json()["detail"]
    response = c.post(
        "/v1/tenants", json={"name": "big", "quota_bytes": 2**60}, headers=api.operator
    )
    assert response.status_code == 409 and response.json()["error"] == "quota_exceeded"
    bad_json = c.post(
        "/v1/tenants",
        content=b"{nope",
        headers={**api.operator, "content-type": "application/json"},
    )
    assert bad_json.status_code == 422
    assert c.get("/v1/tenants/acme/usage?since=nan", headers=api.operator).status_code == 422
    assert c.get("/v1/tenants/acme/usage?since=5&until=1", headers=api.operator).status_code == 422


def test_tenant_admin_sees_and_manages_only_its_tenant(api: Api) -> None:
    c = api.client
    assert [t["name"] for t in c.get("/v1/tenants", headers=api.acme).json()] == ["acme"]
    assert c.get("/v1/tenants/acme", headers=api.acme).status_code == 200
    assert (
        c.patch("/v1/tenants/acme", json={"retention": {"agent": "2d"}}, headers=api.acme).json()[
            "retention"
        ]["agent"]
        == 2 * 86400
    )
    assert (
        c.patch("/v1/tenants/acme", json={"quota_bytes": 10}, headers=api.acme).status_code == 403
    )
    assert c.delete("/v1/tenants/acme", headers=api.acme).status_code == 403
    assert c.post("/v1/tenants", json={"name": "mine"}, headers=api.acme).status_code == 403


def test_auditor_is_read_only(api: Api) -> None:
    c = api.client
    assert c.get("/v1/tenants", headers=api.auditor).status_code == 403
    assert c.get("/v1/tenants/acme", headers=api.auditor).status_code == 403
    assert c.post("/v1/tenants/acme/keys/rotate", headers=api.auditor).status_code == 403
    assert c.post("/v1/tenants", json={"name": "n"}, headers=api.auditor).status_code == 403
    assert c.get("/v1/audit/export", headers=api.auditor).status_code == 200
    assert c.post("/v1/audit/checkpoints", headers=api.auditor).status_code == 403


# ---- keys, usage, purge ------------------------------------------------------------------------


def test_rotate_and_retire_keys(api: Api) -> None:
    tokens = store_some(api.kv, "acme")
    rotated = api.client.post("/v1/tenants/acme/keys/rotate", headers=api.acme)
    assert rotated.status_code == 200 and rotated.json() == {"key_version": 2}
    started = api.client.post("/v1/tenants/acme/keys/retire", headers=api.acme)
    job = finished_job(api.client, started, api.acme)
    assert job["state"] == "succeeded" and job["kind"] == "keys.retire", job
    assert job["result"]["retired_versions"] == [1] and job["result"]["resealed"] == 1
    assert job["done"] == job["total"] == 1
    ns = api.kv.namespace("acme", model="m", layout=MLA_SMALL)
    assert ns.lookup(tokens) == 128


def test_usage_reports_hits_misses_bytes_and_cost(api: Api) -> None:
    tokens = store_some(api.kv, "acme", scope="s1")
    ns = api.kv.namespace("acme", model="m", layout=MLA_SMALL, scope="s1")
    ns.lookup(tokens + random_tokens(64, seed=9))
    response = api.client.get("/v1/tenants/acme/usage", params={"scope": "s1"}, headers=api.acme)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["hit_tokens"] >= 128 and body["stored_bytes"] > 0 and body["stored_tokens"] == 128
    assert body["cost_units"] == pytest.approx(body["miss_tokens"] + body["served_tokens"] / 50)
    other = api.client.get("/v1/tenants/acme/usage", params={"scope": "s2"}, headers=api.acme)
    assert other.json()["stored_tokens"] == 0


def test_purge_a_scope_then_the_tenant(api: Api) -> None:
    in_s1 = store_some(api.kv, "acme", scope="s1", seed=1)
    in_s2 = store_some(api.kv, "acme", scope="s2", seed=2)
    theirs = store_some(api.kv, "globex", scope="s1", seed=1)
    response = api.client.post("/v1/tenants/acme/purge", json={"scope": "s1"}, headers=api.acme)
    assert finished_job(api.client, response, api.acme)["result"]["extents"] == 1
    s1 = api.kv.namespace("acme", model="m", layout=MLA_SMALL, scope="s1")
    s2 = api.kv.namespace("acme", model="m", layout=MLA_SMALL, scope="s2")
    assert s1.lookup(in_s1) == 0 and s2.lookup(in_s2) == 128
    response = api.client.post("/v1/tenants/acme/purge", headers=api.acme)
    assert finished_job(api.client, response, api.acme)["result"]["extents"] == 1
    assert s2.lookup(in_s2) == 0
    g = api.kv.namespace("globex", model="m", layout=MLA_SMALL, scope="s1")
    assert g.lookup(theirs) == 128  # the other tenant keeps its cache
    assert api.kv.get_tenant("acme").key_version == 1  # purge is not deletion


# ---- tokens ------------------------------------------------------------------------------------


def test_tenant_tokens_create_list_revoke(api: Api) -> None:
    c = api.client
    made = c.post("/v1/tenants/acme/tokens", json={"ttl_seconds": 3600}, headers=api.acme)
    assert made.status_code == 201
    token, token_id = made.json()["token"], made.json()["token_id"]
    assert token.startswith("tkv_") and token_id == token_id_of(token)
    listed = c.get("/v1/tenants/acme/tokens", headers=api.acme).json()
    assert token_id in [t["id"] for t in listed] and all("token" not in t for t in listed)
    assert c.get("/v1/tenants/acme", headers=bearer(token)).status_code == 200
    assert c.delete(f"/v1/tenants/acme/tokens/{token_id}", headers=api.acme).status_code == 204
    assert c.get("/v1/tenants/acme", headers=bearer(token)).status_code == 401
    # another tenant's token id through one's own tenant: no such token
    globex_id = c.post("/v1/tenants/globex/tokens", headers=api.globex).json()["token_id"]
    assert c.delete(f"/v1/tenants/acme/tokens/{globex_id}", headers=api.acme).status_code == 404


def test_operator_token_management(api: Api) -> None:
    c = api.client
    made = c.post("/v1/tokens", json={"role": "auditor"}, headers=api.operator)
    assert made.status_code == 201 and made.json()["tenant"] is None
    assert (
        c.post("/v1/tokens", json={"role": "tenant-admin"}, headers=api.operator).status_code == 422
    )
    assert c.post("/v1/tokens", json={"role": "root"}, headers=api.operator).status_code == 422
    assert c.post("/v1/tokens", json={"role": "auditor"}, headers=api.acme).status_code == 403
    token_id = made.json()["token_id"]
    assert c.delete(f"/v1/tokens/{token_id}", headers=api.operator).status_code == 204
    assert c.get("/v1/audit/public-key", headers=bearer(made.json()["token"])).status_code == 401
    assert c.delete("/v1/tokens/0123456789abcdef", headers=api.operator).status_code == 404
    assert api.kv.tokens.revoke("0123456789abcdef") is False


# The token table as tenantkv made it before tokens were bound to a tenant id and a minter.
_OLD_TOKEN_TABLE = (
    "CREATE TABLE tkv_api_tokens (id VARCHAR(32) PRIMARY KEY, token_hash VARCHAR(64) UNIQUE, "
    "role VARCHAR(32), tenant VARCHAR(128), created_at FLOAT, created_by VARCHAR(256), "
    "expires_at FLOAT, revoked_at FLOAT)"
)


def _old_token_row(token: str, role: str, tenant: str | None, at: float, by: str) -> dict[str, Any]:
    digest = hash_token(token)
    return {"id": digest[:16], "hash": digest, "role": role, "tenant": tenant, "at": at, "by": by}


@pytest.mark.usefixtures("index")
def test_an_older_token_table_is_brought_up_to_date_by_db_upgrade(tmp_path: Path) -> None:
    """The token table of an index from before the ``identity_audit_macs`` revision: opening
    refuses it; ``tenantkv db upgrade`` adds the columns and backfills them."""
    root = tmp_path / "cache"
    kv = tenantkv.open(root, durable=False)
    try:
        columns = inspect(kv.context.index.engine).get_columns("tkv_api_tokens")
        assert {"tenant_id", "minted_by"} <= {c["name"] for c in columns}  # made at open
        created = kv.create_tenant("acme").created_at
        tokens = ["tkv_" + secrets.token_urlsafe(32) for _ in range(3)]
        earlier, later, minted = tokens
        rows = [
            _old_token_row(earlier, "tenant-admin", "acme", created - 10, "cli"),  # predecessor's
            _old_token_row(later, "tenant-admin", "acme", created + 1, "cli"),
            _old_token_row(minted, "tenant-admin", "acme", created + 2, ""),
        ]
        rows[2]["by"] = "token:" + rows[1]["id"]  # minted over the API by `later`
        with kv.context.index.write_connection() as connection:
            connection.execute(text("DROP TABLE tkv_api_tokens"))
            connection.execute(text(_OLD_TOKEN_TABLE))
            connection.execute(
                text(
                    "INSERT INTO tkv_api_tokens (id, token_hash, role, tenant, created_at, "
                    "created_by) VALUES (:id, :hash, :role, :tenant, :at, :by)"
                ),
                rows,
            )
            connection.execute(text("UPDATE alembic_version SET version_num = 'fleet_tables'"))
    finally:
        kv.close()
    with pytest.raises(SchemaVersionError, match="tenantkv db upgrade"):
        tenantkv.open(root, durable=False)
    assert main(["db", "upgrade", str(root)]) == 0
    kv = tenantkv.open(root, durable=False)
    try:
        assert kv.tokens.authenticate(later).tenant == "acme"  # positive control
        assert kv.tokens.authenticate(minted).tenant == "acme"
        with pytest.raises(AuthError, match="unbound"):
            kv.tokens.authenticate(earlier)  # made before this tenant existed: not bound to it
        assert kv.tokens.revoke(token_id_of(later))
        with pytest.raises(AuthError, match="revoked"):
            kv.tokens.authenticate(minted)  # its minter was recovered from created_by
    finally:
        kv.close()


# ---- audit -------------------------------------------------------------------------------------


def test_state_changes_are_audited_with_the_caller(api: Api) -> None:
    api.client.post("/v1/tenants/acme/keys/rotate", headers={**api.acme, "X-Request-ID": "req-7"})
    acme_id = token_id_of(api.acme["Authorization"].removeprefix("Bearer "))
    records = audit_records(api.kv, "acme")
    rotate = [r for r in records if r["action"] == "keys.rotate"]
    assert len(rotate) == 1
    assert rotate[0]["actor"] == f"token:{acme_id}" and rotate[0]["role"] == "tenant-admin"
    assert rotate[0]["request_id"] == "req-7"


def test_export_formats_and_offline_verification(api: Api) -> None:
    c = api.client
    c.post("/v1/tenants/acme/keys/rotate", headers=api.acme)
    pem = c.get("/v1/audit/public-key", headers=api.acme)
    assert pem.status_code == 200 and pem.text.startswith("-----BEGIN PUBLIC KEY-----")
    exported = c.get("/v1/audit/export", params={"fmt": "jsonl"}, headers=api.acme)
    assert exported.status_code == 200
    report = verify_export(exported.text.splitlines(), pem.content)
    assert report.ok, report.problems
    assert "globex" not in exported.text  # a tenant-admin reads its own chain only
    for fmt in ("cef", "ocsf"):
        response = c.get("/v1/audit/export", params={"fmt": fmt}, headers=api.auditor)
        assert response.status_code == 200 and response.text.strip()
    assert c.get("/v1/audit/export", params={"fmt": "xml"}, headers=api.auditor).status_code == 422
    everything = c.get("/v1/audit/export", headers=api.operator)
    assert "tenant:globex" in everything.text and "tenant:acme" in everything.text


def test_an_export_of_a_tampered_log_is_refused_before_it_starts(api: Api) -> None:
    """A chain whose head fails its MAC makes the export a 409, not a 200 that stops short."""
    whole = api.client.get("/v1/audit/export", headers=api.operator)
    assert whole.status_code == 200 and "tenant:acme@" in whole.text  # positive control
    with api.kv.context.index.engine.begin() as connection:
        connection.execute(
            text(
                "UPDATE tkv_audit_heads SET last_seq = last_seq - 1 "
                "WHERE chain LIKE 'tenant:acme@%'"
            )
        )
    refused = api.client.get("/v1/audit/export", headers=api.operator)
    assert refused.status_code == 409 and refused.json()["error"] == "audit_chain"
    assert api.client.get("/v1/audit/export", headers=api.globex).status_code == 200


def test_checkpoints(api: Api) -> None:
    c = api.client
    made = c.post("/v1/audit/checkpoints", json={"tenant": "acme"}, headers=api.operator)
    assert made.status_code == 201 and made.json()["chain"] == tenant_chain(api.kv, "acme")
    listed = c.get("/v1/audit/checkpoints", params={"tenant": "acme"}, headers=api.acme)
    assert [cp["seq"] for cp in listed.json()] == [made.json()["seq"]]


# ---- a real server -----------------------------------------------------------------------------


@pytest.mark.usefixtures("index")
def test_real_uvicorn_server(tmp_path: Path) -> None:
    kv = tenantkv.open(tmp_path / "cache", durable=False, capacity_bytes=2**40)
    port = free_port()
    try:
        operator = kv.tokens.ensure_first_operator()
        assert operator is not None
        config = uvicorn.Config(
            create_app(kv, Settings()), host="127.0.0.1", port=port, log_level="warning"
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start within 10 s"
            time.sleep(0.02)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=5) as client:
            assert client.get("/healthz").json() == {"status": "ok"}
            assert client.get("/v1/tenants").status_code == 401
            made = client.post("/v1/tenants", json={"name": "acme"}, headers=bearer(operator))
            assert made.status_code == 201
            with client.stream(
                "GET", "/v1/audit/export", params={"tenant": "acme"}, headers=bearer(operator)
            ) as response:
                lines = [line for line in response.iter_lines() if line]
            assert response.status_code == 200 and any("tenant.create" in ln for ln in lines)
        server.should_exit = True
        thread.join(timeout=10)
        assert not thread.is_alive()
    finally:
        kv.close()
