"""Metrics labels come from sets the code fixes, never from what a client sends (issue 32).

Every distinct label value is a series the registry keeps for the life of the process and
renders at every scrape. The request counters once labelled the raw HTTP method, and the server
accepts any token as a method: 20,000 anonymous requests with invented methods added 20,000
series. These tests send invented methods and random paths through the real app and count the
label values ``/metrics`` then holds; the control checks that an ordinary authenticated request
is still counted under its method, route template and status class.
"""

from __future__ import annotations

import secrets
from collections import defaultdict

import pytest

pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families

from tenantkv.server.metrics import OTHER_METHOD, STANDARD_METHODS, UNMATCHED_ROUTE
from tests.test_server import Api, api_fixture  # noqa: F401

REQUEST_FAMILIES = ("tenantkv_http_requests_total", "tenantkv_http_request_seconds_total")
STATUS_CLASSES = {"1xx", "2xx", "3xx", "4xx", "5xx"}
INVENTED = 200  # requests with invented methods
RANDOM_PATHS = 200  # GETs of paths no route matches


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def request_samples(api: Api) -> Samples:
    """The request counters' samples on ``/metrics``, read as the auditor (a Prometheus scrape):
    (sample name, sorted labels) -> value."""
    response = api.client.get("/metrics", headers=api.auditor)
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name in REQUEST_FAMILIES
    }


def label_values(samples: Samples) -> dict[str, set[str]]:
    values: dict[str, set[str]] = defaultdict(set)
    for _, labels in samples:
        for name, value in labels:
            values[name].add(value)
    return values


def test_invented_methods_and_random_paths_add_no_label_values(api: Api) -> None:
    for i in range(INVENTED):
        method = f"X{secrets.token_hex(6).upper()}"
        path = "/v1/tenants" if i % 2 else f"/{secrets.token_hex(8)}"
        answer = api.client.request(method, path)
        assert answer.status_code == 401  # anonymous: refused before any route runs
    for _ in range(RANDOM_PATHS):
        answer = api.client.get(f"/v1/{secrets.token_hex(8)}/{secrets.token_hex(4)}")
        assert answer.status_code == 401
    # Positive control: an ordinary authenticated request, under its template and method.
    assert api.client.get("/v1/tenants/acme", headers=api.acme).status_code == 200

    samples = request_samples(api)
    values = label_values(samples)
    assert values["method"] <= STANDARD_METHODS | {OTHER_METHOD}
    # Templates of the routes requested (a refused request is labelled with its route's
    # template where the router lets the gate find it, else "unmatched"), never a raw path.
    assert values["route"] <= {"/v1/tenants", "/v1/tenants/{name}", UNMATCHED_ROUTE}
    assert values["status"] <= STATUS_CLASSES
    # 400 requests chose their methods and paths: the series are still a handful.
    assert len(values["method"]) <= 2, values
    assert len(samples) <= 20, sorted(samples)

    control = (("method", "GET"), ("route", "/v1/tenants/{name}"), ("status", "2xx"))
    assert samples[("tenantkv_http_requests_total", control)] == 1
    seconds = (("method", "GET"), ("route", "/v1/tenants/{name}"))
    assert samples[("tenantkv_http_request_seconds_total", seconds)] > 0
    # The invented requests are counted (under "other"), not dropped.
    invented = sum(
        value
        for (name, labels), value in samples.items()
        if name == "tenantkv_http_requests_total" and ("method", OTHER_METHOD) in labels
    )
    assert invented == INVENTED
    unmatched = (("method", "GET"), ("route", UNMATCHED_ROUTE), ("status", "4xx"))
    assert samples[("tenantkv_http_requests_total", unmatched)] == RANDOM_PATHS
    # A refused request to a real route is labelled with that route's template.
    refused = (("method", OTHER_METHOD), ("route", "/v1/tenants"), ("status", "4xx"))
    assert samples[("tenantkv_http_requests_total", refused)] == INVENTED // 2
