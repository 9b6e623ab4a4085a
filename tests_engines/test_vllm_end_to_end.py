"""vLLM end to end on CPU: ``LLM(...)`` loads the tenantkv connector and serves tiny random
models (a GQA Llama, and an MLA DeepSeek-V2 on vLLM's CPU_MLA backend).

Each engine runs in a child process (``tests_engines/vllm_scenario.py``): vLLM keeps its KV
connector in a process-wide global. vLLM's own prefix cache is off there, so a cached token can
only come from the connector. The positive controls: the owner's repeated request hits (and
generates the same greedy tokens as the uncached one), and vLLM's in-tree ExampleConnector, in
the same scenario, serves tenant A's KV to tenant B: the leak these tests would see.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import tenantkv
from tenantkv.integrations.engine_identity import ASSERTION_REFUSED
from tenantkv.tenant_assertion import AssertionSigner
from tests.indexes import Index

PROMPT = list(range(10, 110))  # 100 tokens; 96 of them in full blocks before the last token
REPO = Path(__file__).resolve().parents[1]


def run_scenario(tmp_path: Path, spec: dict[str, Any]) -> dict[str, Any]:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, "-m", "tests_engines.vllm_scenario", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("SCENARIO ")]
    assert lines, f"the scenario failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    report: dict[str, Any] = json.loads(lines[-1].removeprefix("SCENARIO "))
    report["by_name"] = {r["name"]: r for r in report["results"]}
    return report


def tenantkv_spec(
    tmp_path: Path, index: Index, model: Path, pem: str, requests: list[dict[str, Any]]
) -> dict[str, Any]:
    root = tmp_path / "cache"
    with tenantkv.open(root, durable=False) as kv:
        kv.create_tenant("acme")
        kv.create_tenant("globex")
    return {
        "model": str(model),
        "connector": "tenantkv",
        "extra": {
            "root": str(root),
            "open_options": {"database_url": index.url(root), "durable": False},
            "gateway_public_keys": [pem],
            "model": model.name,
        },
        "requests": requests,
    }


def assertion(signer: AssertionSigner, tenant: str) -> dict[str, str]:
    return {"tenantkv_assertion": signer.sign(tenant, ttl=240)}


def test_llama_owner_hits_with_identical_tokens_everyone_else_misses(
    tmp_path: Path,
    index: Index,
    tiny_llama: Path,
    gateway: AssertionSigner,
    gateway_key: Ed25519PrivateKey,
    gateway_pem: str,
) -> None:
    stale = AssertionSigner(gateway_key, clock=lambda: time.time() - 600).sign("acme", ttl=60)
    rogue = AssertionSigner(Ed25519PrivateKey.generate()).sign("acme", ttl=240)
    requests = [
        {"name": "first", "params": assertion(gateway, "acme")},
        {"name": "again", "params": assertion(gateway, "acme")},
        {"name": "globex", "params": assertion(gateway, "globex")},
        {"name": "forged", "params": {"tenantkv_assertion": rogue}},
        {"name": "expired", "params": {"tenantkv_assertion": stale}},
        {"name": "unsigned", "params": None, "salt": "acme"},
        {"name": "owner-last", "params": assertion(gateway, "acme")},
    ]
    spec = tenantkv_spec(
        tmp_path, index, tiny_llama, gateway_pem, [r | {"prompt": PROMPT} for r in requests]
    )
    report = run_scenario(tmp_path, spec)
    runs = report["by_name"]
    assert runs["first"]["num_cached_tokens"] == 0
    # positive controls: the owner hits, and greedy decoding gives the uncached tokens
    for name in ("again", "owner-last"):
        assert runs[name]["num_cached_tokens"] == 96, name
        assert runs[name]["tokens"] == runs["first"]["tokens"], name
    for name in ("globex", "forged", "expired", "unsigned"):
        assert runs[name]["num_cached_tokens"] == 0, name
    assert report["security_events"][ASSERTION_REFUSED] == 3  # forged, expired, unsigned
    assert report["usage"]["acme"]["hit_tokens"] == 192
    assert report["usage"]["globex"]["stored_tokens"] == 96  # its own copy, computed


def owner_and_other_spec(
    tmp_path: Path, index: Index, model: Path, gateway: AssertionSigner, pem: str
) -> dict[str, Any]:
    """A scenario of the owner's miss, another tenant's request for the same prompt, and the
    owner's hit (checked by :func:`assert_the_owner_alone_hits`)."""
    requests = [
        {"name": "first", "params": assertion(gateway, "acme")},
        {"name": "globex", "params": assertion(gateway, "globex")},
        {"name": "again", "params": assertion(gateway, "acme")},
    ]
    return tenantkv_spec(tmp_path, index, model, pem, [r | {"prompt": PROMPT} for r in requests])


def assert_the_owner_alone_hits(runs: dict[str, Any]) -> None:
    """The owner's repeat hits all 96 tokens of full blocks and generates what its uncached
    request did (the positive control); the other tenant misses."""
    assert runs["first"]["num_cached_tokens"] == 0
    assert runs["globex"]["num_cached_tokens"] == 0
    assert runs["again"]["num_cached_tokens"] == 96
    assert runs["again"]["tokens"] == runs["first"]["tokens"]


@pytest.mark.one_index  # a real engine per backend costs ~10 s; the load mode is not the index's
def test_a_load_before_the_forward_gives_the_uncached_tokens(
    tmp_path: Path, index: Index, tiny_llama: Path, gateway: AssertionSigner, gateway_pem: str
) -> None:
    """``layer_wise = false`` in a real engine: the whole load in ``start_load_kv``, then the
    forward; the owner's hit generates what its uncached request did, and another tenant still
    misses."""
    spec = owner_and_other_spec(tmp_path, index, tiny_llama, gateway, gateway_pem)
    spec["extra"]["layer_wise"] = False
    assert_the_owner_alone_hits(run_scenario(tmp_path, spec)["by_name"])


def test_mla_model_hits_for_its_owner_only(
    tmp_path: Path,
    index: Index,
    tiny_deepseek: Path,
    gateway: AssertionSigner,
    gateway_pem: str,
) -> None:
    spec = owner_and_other_spec(tmp_path, index, tiny_deepseek, gateway, gateway_pem)
    # vLLM prefers its AMX MLA backend on CPUs with AMX, which takes no float32 weights: ask
    # for CPU_MLA, the backend this test is written for, on every machine.
    spec["attention_backend"] = "CPU_MLA"
    # 96 tokens: 6 blocks of 16 (CPU_MLA's block size)
    assert_the_owner_alone_hits(run_scenario(tmp_path, spec)["by_name"])


def test_example_connector_leaks_across_salts(tmp_path: Path, tiny_llama: Path) -> None:
    """The positive control for the isolation tests: vLLM's ExampleConnector keys on token
    bytes alone, so tenant B's request (another cache_salt) loads tenant A's stored KV."""
    spec = {
        "model": str(tiny_llama),
        "connector": "example",
        "extra": {"shared_storage_path": str(tmp_path / "example-store")},
        "requests": [
            {"name": "tenantA", "prompt": PROMPT, "params": None, "salt": "tenantA"},
            {"name": "tenantB", "prompt": PROMPT, "params": None, "salt": "tenantB"},
        ],
    }
    runs = run_scenario(tmp_path, spec)["by_name"]
    assert runs["tenantA"]["num_cached_tokens"] == 0
    assert runs["tenantB"]["num_cached_tokens"] == 96  # the leak
