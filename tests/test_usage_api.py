"""Usage for operators over HTTP (issue 37): every tenant in one call (operators and auditors),
time filters in ISO 8601 or epoch seconds, a window under the metering resolution refused with
the resolution named; token names and ``/v1/whoami``."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

pytest.importorskip("fastapi")

from tests.helpers import MLA_SMALL, random_tokens
from tests.test_server import (  # noqa: F401
    Api,
    api_fixture,
    bearer,
    store_some,
)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def test_every_tenants_usage_in_one_call(api: Api) -> None:
    tokens = store_some(api.kv, "acme")
    api.kv.namespace("acme", model="m", layout=MLA_SMALL).lookup(tokens + random_tokens(128, 7))
    now = api.kv.now()
    expected = api.kv.usage("acme").counters
    assert expected["miss_tokens"] == 128  # the lookup's unknown half
    for headers in (api.operator, api.auditor):  # both roles may read it
        response = api.client.get("/v1/usage", params={"since": _iso(now - 3600)}, headers=headers)
        assert response.status_code == 200, response.text
        rows = {row["tenant"]: row for row in response.json()}
        assert set(rows) == {"acme", "globex"}
        assert rows["acme"]["hit_tokens"] == expected["hit_tokens"] >= 128
        assert rows["acme"]["miss_tokens"] == 128
        ratio = expected["hit_tokens"] / (expected["hit_tokens"] + 128)
        assert rows["acme"]["hit_ratio"] == pytest.approx(ratio)
        assert rows["globex"]["hit_ratio"] is None and rows["globex"]["cost_units"] == 0
    assert api.client.get("/v1/usage", headers=api.acme).status_code == 403


def _served_bytes(api: Api) -> dict[str, int]:
    response = api.client.get("/v1/usage", headers=api.operator)
    assert response.status_code == 200, response.text
    return {row["tenant"]: row["served_bytes"] for row in response.json()}


def _load_all(api: Api, tenant: str, tokens: list[int]) -> int:
    """Load every layer of ``tokens`` as ``tenant``; the decoded bytes the caller got."""
    with api.kv.namespace(tenant, model="m", layout=MLA_SMALL).load(tokens) as stream:
        return sum(tensor.numel() * tensor.element_size() for _, tensor in stream)


def test_bytes_served_move_for_the_tenant_whose_load_hit_only(api: Api) -> None:
    acme_tokens = store_some(api.kv, "acme", seed=1)
    globex_tokens = store_some(api.kv, "globex", seed=2)
    assert _served_bytes(api) == {"acme": 0, "globex": 0}  # storing serves nothing
    got = _load_all(api, "acme", acme_tokens)
    assert got == 128 * MLA_SMALL.num_layers * MLA_SMALL.token_bytes  # the decoded tensors
    assert _served_bytes(api) == {"acme": got, "globex": 0}  # globex's count did not move
    assert api.kv.usage("acme").counters["served_bytes"] == got
    globex_got = _load_all(api, "globex", globex_tokens[:64])  # positive control: its own hit
    assert _served_bytes(api) == {"acme": got, "globex": globex_got}
    assert globex_got == got // 2
    with api.kv.namespace("acme", model="m", layout=MLA_SMALL).load(acme_tokens) as stream:
        next(iter(stream))  # one layer of three: the load is not a full serve
    assert _served_bytes(api)["acme"] == got


def test_time_filters_take_iso_8601_epoch_seconds_and_relative_times(api: Api) -> None:
    tokens = store_some(api.kv, "acme")
    api.kv.namespace("acme", model="m", layout=MLA_SMALL).lookup(tokens)
    now = api.kv.now()
    hits = api.kv.usage("acme").counters["hit_tokens"]
    assert hits >= 128
    for since in (_iso(now - 3600), str(int(now - 3600)), "1h"):
        body = api.client.get(
            "/v1/tenants/acme/usage", params={"since": since}, headers=api.acme
        ).json()
        assert body["hit_tokens"] == hits, (since, body)
    before = api.client.get(
        "/v1/tenants/acme/usage",
        params={"since": "2020-01-01T00:00:00Z", "until": "2020-01-02T00:00:00+00:00"},
        headers=api.acme,
    ).json()
    assert before["hit_tokens"] == 0  # a window before the use holds none of it
    bad = api.client.get("/v1/tenants/acme/usage", params={"since": "soon"}, headers=api.acme)
    assert bad.status_code == 422 and "'soon' is not a point in time" in bad.json()["detail"]


def test_a_window_under_the_metering_resolution_is_refused(api: Api) -> None:
    now = int(api.kv.now())
    for path, headers in (("/v1/tenants/acme/usage", api.acme), ("/v1/usage", api.operator)):
        short = api.client.get(
            path, params={"since": str(now - 100), "until": str(now - 70)}, headers=headers
        )
        assert short.status_code == 422
        assert "metering resolution of 60 seconds" in short.json()["detail"]
        enough = api.client.get(
            path, params={"since": str(now - 100), "until": str(now - 40)}, headers=headers
        )
        assert enough.status_code == 200  # positive control: a minute is enough


def test_tokens_carry_names_and_whoami_answers_for_the_caller(api: Api) -> None:
    made = api.client.post(
        "/v1/tokens", json={"role": "auditor", "name": "siem-export"}, headers=api.operator
    )
    assert made.status_code == 201 and made.json()["name"] == "siem-export"
    listed = {t["id"]: t for t in api.client.get("/v1/tokens", headers=api.operator).json()}
    assert listed[made.json()["token_id"]]["name"] == "siem-export"
    who = api.client.get("/v1/whoami", headers=bearer(made.json()["token"])).json()
    assert who == {
        "token_id": made.json()["token_id"],
        "name": "siem-export",
        "role": "auditor",
        "tenant": None,
        "expires_at": made.json()["expires_at"],
    }
    mine = api.client.get("/v1/whoami", headers=api.acme).json()
    assert mine["role"] == "tenant-admin" and mine["tenant"] == "acme" and mine["name"] is None
    assert api.client.get("/v1/whoami").status_code == 401
    bad = api.client.post(
        "/v1/tokens", json={"role": "auditor", "name": "has space"}, headers=api.operator
    )
    assert bad.status_code == 422
