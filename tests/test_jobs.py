"""Long operations as jobs (issue 37): started by the admin API with 202, run whatever becomes
of the client, failures recorded, a runner killed mid-job found interrupted by the next server
start and resumed to completion. On both index backends (the ``index`` fixture)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
import uvicorn
from fastapi.testclient import TestClient

import tenantkv
from tenantkv import JobNotFoundError, JobStateError, TenantKV
from tenantkv.server.app import create_app
from tenantkv.server.settings import Settings
from tests.helpers import MLA_SMALL, random_layers, random_tokens
from tests.indexes import _CLI_WITH_URL, Index
from tests.ports import free_port
from tests.test_server import bearer, finished_job


def store_extents(kv: TenantKV, tenant: str, count: int) -> list[list[int]]:
    """``count`` extents of ``tenant`` (one prefix each); returns their tokens."""
    ns = kv.namespace(tenant, model="m", layout=MLA_SMALL)
    prompts = []
    for seed in range(count):
        tokens = random_tokens(64, seed=1000 + seed)
        ns.store(tokens, random_layers(MLA_SMALL, 64, seed=seed))
        prompts.append(tokens)
    return prompts


def all_cached(kv: TenantKV, tenant: str, prompts: list[list[int]]) -> bool:
    ns = kv.namespace(tenant, model="m", layout=MLA_SMALL)
    return all(ns.lookup(tokens) == len(tokens) for tokens in prompts)


@pytest.fixture(name="kv")
def kv_fixture(tmp_path: Path, index: Index) -> Iterator[TenantKV]:
    with tenantkv.open(tmp_path / "cache", durable=False) as kv:
        kv.create_tenant("acme")
        yield kv


def test_a_job_runs_on_after_its_client_disconnects(kv: TenantKV) -> None:
    """A real server: the client that started the retirement closes its connection at once;
    the job still finishes, and another client reads its result."""
    prompts = store_extents(kv, "acme", 6)
    kv.rotate_keys("acme")
    operator = kv.tokens.ensure_first_operator()
    assert operator is not None
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(kv, Settings()), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start within 10 s"
            time.sleep(0.02)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=10) as client:
            started = client.post("/v1/tenants/acme/keys/retire", headers=bearer(operator))
        # that client is gone; a new one polls
        assert started.status_code == 202, started.text
        job_id = started.json()["id"]
        with httpx.Client(base_url=base, timeout=10) as other:
            deadline = time.monotonic() + 60
            while True:
                job = other.get(f"/v1/jobs/{job_id}", headers=bearer(operator)).json()
                if job["state"] not in ("queued", "running"):
                    break
                assert time.monotonic() < deadline, job
                time.sleep(0.02)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert job["state"] == "succeeded", job
    assert job["result"]["resealed"] == 6 and job["result"]["retired_versions"] == [1]
    assert job["done"] == job["total"] == 6
    assert kv.get_tenant("acme").key_versions == (2,)
    assert all_cached(kv, "acme", prompts)  # nothing lost by the re-seal


def test_a_failed_job_says_why_and_resumes(kv: TenantKV) -> None:
    """A purge of a tenant deleted (and created again) after the job was queued fails with a
    sentence; the new tenant of that name is untouched; resuming fails again, not silently."""
    operator = kv.tokens.ensure_first_operator()
    assert operator is not None
    info = kv.jobs.start("purge", "acme")
    kv.delete_tenant("acme")
    kv.create_tenant("acme")
    prompts = store_extents(kv, "acme", 1)
    final = kv.jobs.run(info.id)
    assert final.state == "failed" and final.error is not None
    assert "deleted after the job started" in final.error
    assert all_cached(kv, "acme", prompts)  # the new acme kept its cache
    with TestClient(create_app(kv, Settings())) as client:
        shown = client.get(f"/v1/jobs/{info.id}", headers=bearer(operator)).json()
        assert shown["state"] == "failed" and shown["error"] == final.error
        again = client.post(f"/v1/jobs/{info.id}/resume", headers=bearer(operator))
        assert finished_job(client, again, bearer(operator))["state"] == "failed"
        # positive control: a purge of the tenant as it is now succeeds and is seen to
        purged = client.post("/v1/tenants/acme/purge", headers=bearer(operator))
        job = finished_job(client, purged, bearer(operator))
        assert job["state"] == "succeeded" and job["result"]["extents"] == 1
        assert client.get("/v1/jobs/0123456789abcdef", headers=bearer(operator)).status_code == 404
        done = client.post(f"/v1/jobs/{job['id']}/resume", headers=bearer(operator))
        assert done.status_code == 409 and "only an interrupted or failed" in done.json()["detail"]
    assert not all_cached(kv, "acme", prompts)
    with pytest.raises(JobNotFoundError):
        kv.jobs.get("0123456789abcdef")
    with pytest.raises(JobStateError):
        kv.jobs.resume(job["id"])


def test_a_tenant_admin_sees_its_own_tenants_jobs_only(kv: TenantKV) -> None:
    kv.create_tenant("globex")
    operator = kv.tokens.ensure_first_operator()
    assert operator is not None
    acme = bearer(kv.tokens.create("tenant-admin", "acme"))
    globex = bearer(kv.tokens.create("tenant-admin", "globex"))
    with TestClient(create_app(kv, Settings())) as client:
        started = client.post("/v1/tenants/acme/purge", headers=acme)
        job = finished_job(client, started, acme)  # positive control: its owner follows it
        assert job["state"] == "succeeded"
        other = client.get(f"/v1/jobs/{job['id']}", headers=globex)
        missing = client.get("/v1/jobs/0123456789abcdef", headers=globex)
        assert other.status_code == missing.status_code == 404
        assert other.json() == missing.json()
        assert [j["id"] for j in client.get("/v1/jobs", headers=globex).json()] == []
        gc = client.post("/v1/gc", headers=acme)
        assert gc.status_code == 403
        gc = client.post("/v1/gc", json={"orphan_grace": 0}, headers=bearer(operator))
        assert finished_job(client, gc, bearer(operator))["state"] == "succeeded"


def test_a_killed_runner_is_marked_interrupted_at_server_start_and_resumes(
    kv: TenantKV, index: Index
) -> None:
    """``tenantkv job run`` (what ``--detach`` starts) is killed mid-retirement; the next server
    start marks the job interrupted; ``POST /v1/jobs/{id}/resume`` runs it to the end, and every
    prefix is still cached, under the new key only."""
    prompts = store_extents(kv, "acme", 120)
    kv.rotate_keys("acme")
    operator = kv.tokens.ensure_first_operator()
    assert operator is not None
    info = kv.jobs.start("keys.retire", "acme")
    root = str(kv.config.root)
    runner = subprocess.Popen(
        [sys.executable, "-c", _CLI_WITH_URL, index.url(root), "job", "run", info.id, root],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    try:
        deadline = time.monotonic() + 120
        while (job := kv.jobs.get(info.id)).done < 1:
            assert runner.poll() is None, runner.stderr.read() if runner.stderr else ""
            assert time.monotonic() < deadline, job
            time.sleep(0.01)
        assert job.state == "running"
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=30)
    finally:
        if runner.poll() is None:
            runner.kill()
    assert kv.jobs.get(info.id).done < 120, "the runner finished before it was killed"
    assert kv.get_tenant("acme").key_versions == (1, 2)  # retirement did not get to its end
    with TestClient(create_app(kv, Settings())) as client:  # the server (re)starts
        shown = client.get(f"/v1/jobs/{info.id}", headers=bearer(operator)).json()
        assert shown["state"] == "interrupted", shown
        assert "stopped before it finished" in shown["error"]
        resumed = client.post(f"/v1/jobs/{info.id}/resume", headers=bearer(operator))
        job_after = finished_job(client, resumed, bearer(operator))
    assert job_after["state"] == "succeeded" and job_after["attempts"] == 2, job_after
    assert job_after["result"]["retired_versions"] == [1]
    assert job_after["result"]["extents_on_old_keys"] == 0
    assert kv.get_tenant("acme").key_versions == (2,)
    assert all_cached(kv, "acme", prompts)
