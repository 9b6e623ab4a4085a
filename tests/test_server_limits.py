"""Abuse limits of the admin API (issue 13, items 6 and 7): refused authentications are audited
per source and time window, not one record each; a request is authenticated before its body is
read; bodies are capped."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

pytest.importorskip("fastapi")
from sqlalchemy import func, select

from tenantkv import TenantKV
from tenantkv.audit import AuditRecordRow
from tenantkv.server.refusals import OTHER_SOURCES, RefusalLog
from tests.test_server import Api, api_fixture, audit_records  # noqa: F401

LONG_REQUEST_ID = "caller-chosen-" + "q" * 114  # 128 characters, the most X-Request-ID takes
UNAUTHORIZED = {"error": "unauthorized", "detail": "a valid bearer token is required"}
MIB = 1024 * 1024


def audit_rows(kv: TenantKV) -> int:
    with kv.context.index.read() as session:
        return int(session.scalar(select(func.count()).select_from(AuditRecordRow)) or 0)


def refusal_records(kv: TenantKV) -> list[dict[str, Any]]:
    return [
        r
        for r in audit_records(kv, None)
        if r["action"] == "access.refused" and r["role"] == "unauthenticated"
    ]


# ---- item 6: refused authentications ----------------------------------------------------------


def test_bad_tokens_write_a_bounded_number_of_audit_rows(api: Api) -> None:
    bad_headers = [
        {},  # missing
        {"Authorization": "Bearer not-a-token"},  # malformed
        {"Authorization": "Bearer tkv_" + "x" * 43},  # unknown
        {"Authorization": "Basic Zm9vOmJhcg=="},  # not a bearer token: missing
    ]
    before = audit_rows(api.kv)
    for window in range(2):
        for i in range(1000):
            headers = {**bad_headers[i % len(bad_headers)], "X-Request-ID": LONG_REQUEST_ID}
            answer = api.client.post("/v1/tenants", json={"name": f"t{i}"}, headers=headers)
            assert answer.status_code == 401 and answer.json() == UNAUTHORIZED
            assert answer.headers["www-authenticate"] == "Bearer"
        if window == 0:
            api.clock.now += api.client.app.state.refusals.window_seconds
    # 2,000 refusals, in two windows: the first window's record is written as the second starts
    assert audit_rows(api.kv) - before <= 1
    api.client.app.state.refusals.flush()  # what shutdown does
    assert audit_rows(api.kv) - before == 2
    records = refusal_records(api.kv)
    assert len(records) == 2
    # positive control: the aggregates account for every refusal, by reason
    assert sum(r["details"]["count"] for r in records) == 2000
    assert {r["details"]["source"] for r in records} == {"testclient"}
    totals: dict[str, int] = {}
    for record in records:
        for reason, count in record["details"]["reasons"].items():
            totals[reason] = totals.get(reason, 0) + count
    assert totals == {"missing": 1000, "malformed": 500, "unknown": 500}
    # the callers' request ids are kept nowhere in the log
    assert all(r["request_id"] is None for r in records)
    assert LONG_REQUEST_ID not in json.dumps(audit_records(api.kv, None))
    # and the counts are metrics
    metrics = api.client.get("/metrics", headers=api.operator).text
    assert 'tenantkv_auth_refused_total{reason="missing"} 1000' in metrics
    assert "tenantkv_auth_refusal_records_total 2" in metrics
    # positive control: a valid token still works, and its state changes are still audited
    made = api.client.post("/v1/tenants", json={"name": "t-ok"}, headers=api.operator)
    assert made.status_code == 201
    assert audit_rows(api.kv) - before == 3


def test_sources_past_the_bound_are_folded_into_one_entry(api: Api) -> None:
    refusals = RefusalLog(api.kv, window_seconds=60, max_sources=4)
    before = audit_rows(api.kv)
    for n in range(50):
        for _ in range(3):
            refusals.count(f"198.51.100.{n}", "unknown")
    refusals.count("198.51.100.0", "revoked", "0123456789abcdef")
    refusals.flush()
    assert audit_rows(api.kv) - before == 5  # 4 sources by address, the rest as one
    by_source = {r["details"]["source"]: r["details"] for r in refusal_records(api.kv)}
    assert set(by_source) == {f"198.51.100.{n}" for n in range(4)} | {OTHER_SOURCES}
    assert by_source[OTHER_SOURCES]["count"] == 46 * 3
    assert sum(d["count"] for d in by_source.values()) == 151  # positive control: all counted
    assert by_source["198.51.100.0"]["reasons"] == {"unknown": 3, "revoked": 1}
    assert by_source["198.51.100.0"]["token_ids"] == ["0123456789abcdef"]
    assert refusals.stats().folded == 46 * 3


def test_authenticated_refusals_stay_audited_per_request(api: Api) -> None:
    answer = api.client.get("/v1/tenants/globex", headers={**api.acme, "X-Request-ID": "r-403"})
    assert answer.status_code == 404
    (record,) = [r for r in audit_records(api.kv, "acme") if r["action"] == "access.refused"]
    assert record["request_id"] == "r-403" and record["details"]["reason"] == "other-tenant"


# ---- item 7: authentication before the body, and a cap on bodies ------------------------------


class Pulled:
    """An ASGI ``receive`` serving a body in chunks and counting the bytes the app pulls."""

    def __init__(self, total: int, chunk: int = 64 * 1024) -> None:
        self.total = total
        self.chunk = b"\x20" * chunk
        self.pulled = 0

    async def __call__(self) -> dict[str, Any]:
        if self.pulled >= self.total:
            return {"type": "http.disconnect"}
        size = min(len(self.chunk), self.total - self.pulled)
        self.pulled += size
        more = self.pulled < self.total
        return {"type": "http.request", "body": self.chunk[:size], "more_body": more}


def call_asgi(
    api: Api, path: str, headers: dict[str, str], body: Pulled
) -> tuple[int, dict[str, str], bytes]:
    """POST ``path`` to the app itself (no test client, which would buffer the body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("203.0.113.9", 40000),
        "server": ("testserver", 80),
    }
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    asyncio.run(api.client.app(scope, body, send))
    start = next(m for m in messages if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    answer_headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return int(start["status"]), answer_headers, content


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    "auth", [{}, {"authorization": "Bearer tkv_" + "x" * 43}], ids=["missing", "unknown"]
)
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_an_anonymous_body_is_refused_without_being_read(
    api: Api, auth: dict[str, str], declared: bool
) -> None:
    body = Pulled(48 * MIB)
    length = {"content-length": str(body.total)} if declared else {}
    status, headers, content = call_asgi(api, "/v1/tenants", {**JSON, **length, **auth}, body)
    assert status == 401 and json.loads(content) == UNAUTHORIZED
    assert headers["www-authenticate"] == "Bearer"
    assert body.pulled == 0
    # positive control: the same delivery with a valid token and a real body is read and served
    good = Pulled(0)
    payload = json.dumps({"name": "fresh"}).encode()
    good.total, good.chunk = len(payload), payload
    token = {"authorization": api.operator["Authorization"]}
    status, _, content = call_asgi(api, "/v1/tenants", {**JSON, **token}, good)
    assert status == 201, content
    assert good.pulled == len(payload)


def test_an_authenticated_body_over_the_limit_is_refused_with_413(api: Api) -> None:
    limit = api.client.app.state.settings.max_body_bytes
    token = {"authorization": api.operator["Authorization"]}
    # announced too large: refused before any of it is read
    body = Pulled(limit + 1)
    status, _, content = call_asgi(
        api, "/v1/tenants", {**JSON, **token, "content-length": str(body.total)}, body
    )
    assert status == 413 and json.loads(content)["error"] == "too_large"
    assert body.pulled == 0
    # streamed without a length: cut off at the limit
    body = Pulled(48 * MIB)
    status, _, content = call_asgi(api, "/v1/tenants", {**JSON, **token}, body)
    assert status == 413 and json.loads(content)["error"] == "too_large"
    assert body.pulled <= limit + len(body.chunk)
    # through a client too (JSON that would otherwise be parsed)
    big = {"name": "n" * 10, "retention": {"x": "y" * (limit + 10)}}
    answer = api.client.post("/v1/tenants", json=big, headers=api.operator)
    assert answer.status_code == 413 and answer.json()["error"] == "too_large"
    assert "n" * 10 not in {t.name for t in api.kv.list_tenants()}
    # positive control: a normal authenticated body is accepted
    made = api.client.post(
        "/v1/tenants", json={"name": "normal", "retention": {"agent": "1d"}}, headers=api.operator
    )
    assert made.status_code == 201, made.text


def test_public_paths_need_no_token_and_other_paths_do(api: Api) -> None:
    assert api.client.get("/healthz").status_code == 200
    assert api.client.get("/openapi.json").status_code == 200
    # an unknown path is not a way around the gate: 401, counted under no route template
    assert api.client.get("/v1/no-such-route").status_code == 401
    assert api.client.get("/v1/no-such-route", headers=api.operator).status_code == 404
    assert api.client.get("/metrics").status_code == 401


def test_every_route_of_the_schema_but_healthz_refuses_an_anonymous_caller(api: Api) -> None:
    """No route of the API is left outside the token gate: each answers an anonymous call with
    401, and an operator's call with something else (the route exists and the gate lets a valid
    token through: the positive control)."""
    schema = api.client.get("/openapi.json").json()
    calls = [
        (method.upper(), re.sub(r"\{[^}]+\}", "acme", template))
        for template, operations in schema["paths"].items()
        for method in operations
    ]
    assert len(calls) >= 20  # the whole schema, not an empty one
    for method, path in calls:
        anonymous = api.client.request(method, path)
        if path in ("/healthz", "/readyz"):
            assert anonymous.status_code == 200
            continue
        assert anonymous.status_code == 401, (method, path)
        assert anonymous.json() == UNAUTHORIZED
        assert api.client.request(method, path, headers=api.operator).status_code != 401
