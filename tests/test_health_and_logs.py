"""What an operator's probes and log shippers see: ``kv.health()``, the admin server's
``/healthz`` and ``/readyz``, the console's local assets, and JSON logs without secrets.

Every failing check is made real (a Redis port nothing listens on, an index whose schema stamp
is not this tenantkv's, PostgreSQL behind a forwarder that refuses), each next to the same
cache answering ready (the positive control)."""

from __future__ import annotations

import io
import json
import logging
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.engine import make_url

import tenantkv
from tenantkv.json_logs import JsonFormatter, redact
from tenantkv.server.app import create_app
from tenantkv.server.settings import Settings
from tests.indexes import Index, PostgresSchemas

from .tcp_proxy import TcpProxy


def _dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_health_is_ready_then_names_a_block_store_that_takes_no_write(
    tmp_path: Path, index: Index
) -> None:
    with tenantkv.open(tmp_path / "ok", durable=False) as kv:
        report = kv.health()
        assert report.ready and report.checks == {
            "index": "ok",
            "schema": "ok",
            "block_store": "ok",
        }  # positive control
        assert list(kv.context.blocks.list()) == []  # the probe left nothing behind
    pytest.importorskip("redis")
    url = f"redis://127.0.0.1:{_dead_port()}/0?prefix=tkv-health:&socket_timeout=1"
    with tenantkv.open(tmp_path / "dead", durable=False, block_store_url=url) as kv:
        report = kv.health()
        assert not report.ready
        assert report.checks["block_store"] == "not writable"
        assert report.checks["index"] == "ok"
        assert report.as_dict()["status"] == "unavailable"


def test_health_names_an_index_at_another_schema_revision(tmp_path: Path, index: Index) -> None:
    with tenantkv.open(tmp_path / "cache", durable=False) as kv:
        assert kv.health().ready  # positive control
        with kv.context.index.engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = 'ffffffffffff'"))
        report = kv.health()
        assert not report.ready
        assert "'ffffffffffff'" in report.checks["schema"]
        assert "tenantkv db upgrade" in report.checks["schema"]


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    forwarder = TcpProxy(("127.0.0.1", 5432))
    forwarder.start()
    try:
        yield forwarder
    finally:
        forwarder.stop()


def test_readyz_fails_while_the_index_refuses_and_healthz_stays_alive(
    tmp_path: Path, postgres_schemas: PostgresSchemas, proxy: TcpProxy
) -> None:
    postgres_schemas.connect()
    root = tmp_path / "cache"
    url = make_url(postgres_schemas.url(str(root))).set(host="127.0.0.1", port=proxy.port)
    with (
        tenantkv.open(
            root,
            durable=False,
            database_url=url.render_as_string(hide_password=False),
            index_admin_timeout=2.0,
            index_serving_timeout=2.0,
        ) as kv,
        TestClient(create_app(kv, Settings(root=str(root)))) as client,
    ):
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.text  # positive control
        assert ready.json() == {
            "status": "ready",
            "checks": {"index": "ok", "schema": "ok", "block_store": "ok"},
        }
        proxy.refuse()
        try:
            down = client.get("/readyz")
            assert down.status_code == 503
            assert down.json()["checks"]["index"] == "unreachable"
            assert "psycopg" not in down.text.lower() and str(proxy.port) not in down.text
            assert client.get("/healthz").status_code == 200  # alive: no restart cures it
        finally:
            proxy.heal()
        deadline = time.monotonic() + 30
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "not ready 30 s after the index came back"
            time.sleep(0.1)


@pytest.fixture
def client(tmp_path: Path, index: Index) -> Iterator[tuple[tenantkv.TenantKV, TestClient]]:
    with tenantkv.open(tmp_path / "cache", durable=False) as kv:
        app = create_app(kv, Settings(root=str(tmp_path / "cache")))
        with TestClient(app) as test_client:
            yield kv, test_client


def test_console_loads_only_local_assets_and_they_answer(
    client: tuple[tenantkv.TenantKV, TestClient],
) -> None:
    _, http = client
    page = http.get("/docs")
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    referenced = re.findall(r"""(?:src|href)=["']([^"']+)["']|url:\s*["']([^"']+)["']""", page.text)
    urls = [a or b for a, b in referenced]
    assert len(urls) >= 4, urls  # script, stylesheet, favicon, the schema: the page is complete
    for url in urls:
        assert url.startswith("/"), f"/docs loads {url} from elsewhere"
        answer = http.get(url)  # no token: the page's own files are public
        assert answer.status_code == 200, url
        assert len(answer.content) > 100, url
    assert "cdn" not in page.text.lower()
    assert http.get("/redoc").status_code in (401, 404)  # no CDN page left behind


def _capture_json_logs(tenant_names: bool) -> tuple[io.StringIO, logging.Handler]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(tenant_names=tenant_names))
    logger = logging.getLogger("tenantkv")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return stream, handler


@pytest.mark.parametrize("tenant_names", [False, True])
def test_json_logs_carry_request_ids_never_tokens_or_prompt_text(
    client: tuple[tenantkv.TenantKV, TestClient], tenant_names: bool
) -> None:
    kv, http = client
    operator = kv.tokens.ensure_first_operator()
    assert operator is not None
    kv.create_tenant("acme")
    _, inference_key = kv.inference_keys.create("acme", "app")
    prompt = "You are a helpful assistant. The launch code is 7-4-1-9."
    stream, handler = _capture_json_logs(tenant_names)
    try:
        made = http.get(
            "/v1/tenants/acme",
            headers={"Authorization": f"Bearer {operator}", "X-Request-ID": "req-42"},
        )
        assert made.status_code == 200
        refused = http.post(
            "/v1/tenants",
            headers={"Authorization": f"Bearer {inference_key}"},
            json={"name": "globex", "prompt": prompt},
        )
        assert refused.status_code == 401
        # what a careless caller might log: the formatter still keeps the secrets out
        logging.getLogger("tenantkv").warning(
            "caller sent Authorization: Bearer %s and key %s", operator, inference_key
        )
    finally:
        logging.getLogger("tenantkv").removeHandler(handler)
    output = stream.getvalue()
    lines = [json.loads(line) for line in output.splitlines()]
    access = [line for line in lines if line["logger"] == "tenantkv.access"]
    assert len(access) == 2, output  # positive control: the requests were logged
    first = access[0]
    assert first["request_id"] == "req-42" and first["route"] == "/v1/tenants/{name}"
    assert first["status"] == 200 and access[1]["status"] == 401
    assert ("tenant" in first) is tenant_names
    if tenant_names:
        assert first["tenant"] == "acme"
    assert any("[redacted]" in line["message"] for line in lines)  # the careless line
    for secret in (operator, inference_key, prompt, "launch code", "7-4-1-9"):
        assert secret not in output
    assert "acme" not in output.replace('"tenant": "acme"', "")  # the path is not logged


def test_redact_covers_every_credential_form() -> None:
    assert redact("Bearer abc.def") == "[redacted]"
    assert redact("token tkv_" + "A" * 43 + " end") == "token [redacted] end"
    assert redact("tkvi_" + "b" * 43) == "[redacted]"
    assert redact("tenants: acme, globex") == "tenants: acme, globex"  # nothing else touched


def test_gateway_readyz_adds_the_cache_health(tmp_path: Path, index: Index) -> None:
    """A gateway with a cache is ready only while the cache is; its backend answering in both
    cases, so the cache's health alone decides."""
    pytest.importorskip("httpx")
    pytest.importorskip("redis")
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tenantkv.gateway import create_gateway_app
    from tenantkv.gateway.settings import GatewaySettings
    from tenantkv.tenant_assertion import AssertionSigner
    from tests.gateway_stack import DictAuthenticator, Recording, recording_backend, serving

    dead = f"redis://127.0.0.1:{_dead_port()}/0?prefix=tkv-health:&socket_timeout=1"
    with (
        serving(recording_backend(Recording("b"))) as backend,
        tenantkv.open(tmp_path / "ok", durable=False) as good,
        tenantkv.open(tmp_path / "dead", durable=False, block_store_url=dead) as bad,
    ):
        for kv, status in ((good, 200), (bad, 503)):
            app = create_gateway_app(
                DictAuthenticator({}),
                AssertionSigner(Ed25519PrivateKey.generate()),
                secret=b"g" * 32,
                backends=[backend],
                settings=GatewaySettings(audience="d"),
                cache_health=kv.health,
            )
            with TestClient(app) as client:
                answer = client.get("/readyz")
                assert answer.status_code == status, answer.text
                if status == 503:
                    assert "block_store: not writable" in answer.text
