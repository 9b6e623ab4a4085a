"""Index outages as the edges show them (issue 33): the admin API answers 503 within its bound,
the CLI says one sentence.

tests/test_index_outages.py checks the facade during a fault; the admin API and the CLI sit on
it, and their promises (a 503 with a JSON body that says which backend failed, one line on
stderr) held only by construction. Here a real PostgreSQL index is reached through the same TCP
proxy, refusing or stalled: the admin app (the real ASGI app under TestClient) and a ``tenantkv``
child process must answer within the admin bound plus a margin, without the driver's text
(hosts, statements, exception names), and work again once the proxy heals.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from sqlalchemy import make_url

import tenantkv
from tenantkv.errors import CacheUnavailableError
from tenantkv.server.app import create_app
from tenantkv.server.settings import Settings

from .indexes import Index
from .tcp_proxy import TcpProxy
from .test_index_outages import ADMIN_S, MARGIN_S, SERVING_S, _run_all
from .test_index_outages import proxy as proxy  # the fixture: a forwarder to the test server

#: Text that only the driver or the ORM writes: none of it may reach a client or the terminal.
DRIVER_TEXT = ("psycopg", "sqlalchemy", "OperationalError", "server closed", "Traceback")


def _proxied_url(index: Index, root: Path, proxy: TcpProxy) -> str:
    url = make_url(index.url(root)).set(host="127.0.0.1", port=proxy.port)
    return url.render_as_string(hide_password=False)


def _without_driver_text(text: str, *more: str) -> bool:
    lowered = text.lower()
    return not any(word.lower() in lowered for word in (*DRIVER_TEXT, *more))


def _wait_until_available(kv: tenantkv.TenantKV) -> None:
    started = time.monotonic()
    while True:
        try:
            kv.check_available()
            return
        except CacheUnavailableError:
            assert time.monotonic() - started < 30.0, "no recovery 30 s after healing"
            time.sleep(0.05)


@pytest.mark.parametrize("fault", ["refuse", "stall"])
def test_admin_api_answers_503_within_its_bound_during_an_index_fault(
    tmp_path: Path, index: Index, proxy: TcpProxy, fault: str
) -> None:
    root = tmp_path / "cache"
    with tenantkv.open(
        root,
        durable=False,
        database_url=_proxied_url(index, root, proxy),
        index_serving_timeout=SERVING_S,
        index_admin_timeout=ADMIN_S,
    ) as kv:
        operator = kv.tokens.ensure_first_operator()
        assert operator is not None
        kv.create_tenant("acme")
        headers = {"Authorization": f"Bearer {operator}"}
        with TestClient(create_app(kv, Settings(root=str(root)))) as client:
            before = client.get("/v1/tenants", headers=headers)
            assert before.status_code == 200, before.text  # control: the proxy passes
            assert [t["name"] for t in before.json()] == ["acme"]
            try:
                getattr(proxy, fault)()
                # In a worker thread: a request that hangs fails the test instead of hanging it.
                answers: list[httpx.Response] = []
                outcomes = _run_all(
                    {"list": lambda: answers.append(client.get("/v1/tenants", headers=headers))},
                    deadline_s=ADMIN_S + MARGIN_S + 10.0,
                )
            finally:
                proxy.heal()
            assert outcomes, f"no answer {ADMIN_S + MARGIN_S + 10.0:g} s into a {fault}"
            [outcome] = outcomes
            assert outcome.error is None, repr(outcome.error)
            assert outcome.seconds < ADMIN_S + MARGIN_S, f"503 after {outcome.seconds:.1f} s"
            [during] = answers
            assert during.status_code == 503, (during.status_code, during.text)
            body = during.json()
            assert body["error"] == "unavailable", body
            # nor where the index is: the caller is a client, not the operator
            assert _without_driver_text(during.text, "127.0.0.1", str(proxy.port)), during.text
            _wait_until_available(kv)
            after = client.get("/v1/tenants", headers=headers)
            assert after.status_code == 200, after.text  # the same app and cache, healed
            assert [t["name"] for t in after.json()] == ["acme"]


def _cli(root: Path, url: str, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {
        **os.environ,
        "TENANTKV_DATABASE_URL": url,
        "TENANTKV_INDEX_SERVING_TIMEOUT": str(SERVING_S),
        "TENANTKV_INDEX_ADMIN_TIMEOUT": str(ADMIN_S),
    }
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "tenantkv.cli", *args, str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    return result, time.monotonic() - started


@pytest.mark.parametrize("fault", ["refuse", "stall"])
@pytest.mark.parametrize("command", [("info",), ("token", "list")])
def test_cli_says_one_sentence_within_its_bound_during_an_index_fault(
    tmp_path: Path, index: Index, proxy: TcpProxy, fault: str, command: tuple[str, ...]
) -> None:
    root = tmp_path / "cache"
    url = _proxied_url(index, root, proxy)
    with tenantkv.open(root, durable=False) as kv:  # directly: the root, its key and tables
        kv.create_tenant("acme")
        assert kv.tokens.ensure_first_operator() is not None
    healthy, startup_s = _cli(root, url, *command)
    assert healthy.returncode == 0, healthy.stderr  # control: through the proxy, it works
    assert healthy.stdout.strip() and not healthy.stderr
    try:
        getattr(proxy, fault)()
        during, seconds = _cli(root, url, *command)
    finally:
        proxy.heal()
    # The healthy run's time covers the interpreter's start and the command's own work.
    assert seconds < startup_s + ADMIN_S + MARGIN_S, f"{seconds:.1f} s (healthy: {startup_s:.1f})"
    assert during.returncode != 0, during.stdout
    lines = during.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tenantkv:"), during.stderr
    assert "index" in lines[0], lines[0]
    assert _without_driver_text(during.stderr), during.stderr
    after, _ = _cli(root, url, *command)
    assert after.returncode == 0, after.stderr  # healed: the same command works again
