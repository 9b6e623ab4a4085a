"""The hosted stack the engine tests share: ONE ``vllm serve`` of the CPU build for the whole
session (tests_engines/conftest.py exposes :func:`hosted_stack`), used by test_hosted_stack.py,
test_conformance.py and test_two_backends.py. Starting vLLM costs most of a minute on two
cores, so the stack starts once and every test uses prompts of its own.

``vllm serve`` is started with the documented recipe of docs/gateway.md (the tenantkv
connector by ``--kv-transfer-config`` naming the deployment's one configuration file), the
tiny random Llama and the byte-level tokenizer written at test time; nothing is downloaded.
vLLM runs in dev mode (``VLLM_SERVER_DEV_MODE=1``) so that the tests (and the conformance
suite) can empty its own prefix cache through ``POST /reset_prefix_cache``.

The stack's index is PostgreSQL, the index of a deployment with several nodes (the quickstart
test runs the page's own SQLite index); ``--index=sqlite`` runs it on SQLite instead. It does
not take the parametrized ``index`` fixture: that would start one vLLM per backend.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

import tenantkv
from tenantkv import TenantKV
from tenantkv.cli.gateway import _authenticator, build_gateway, gateway_options
from tenantkv.tenant_assertion import AssertionSigner, public_key_pem
from tests.conftest import selected_index_kinds
from tests.doc_recipes import kv_transfer_config, toml_text, vllm_serve_args
from tests.gateway_stack import serving
from tests.indexes import Index, PostgresSchemas
from tests.ports import free_ports
from tests_engines.tiny_tokenizer import write_tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny"
AUDIENCE = "hosted-e2e"
SECRET = b"g" * 32
#: vLLM's CPU backend takes block sizes that are multiples of 32.
BLOCK = 32
#: What the recipe leaves to the deployment, for a tiny float32 model on vLLM's CPU backend.
CPU_ARGS = [
    "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "1024",
    "--block-size", str(BLOCK), "--enforce-eager", "--max-num-seqs", "4", "--seed", "0",
    "--enable-prefix-caching",
]  # fmt: skip
START_TIMEOUT = 240.0
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


@dataclass(frozen=True)
class Spare:
    """A second ``vllm serve`` of the same model and file, started with the first so that the
    two starts overlap, for the test that needs two backends (test_two_backends.py)."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class Stack:
    """The running stack and what the tests need to drive it."""

    gateway: str  # base URL of the gateway
    vllm: str  # base URL of vllm serve (the tests' back door: resets and direct attacks)
    kv: TenantKV  # the cache, opened by the test process as the admin would
    signer: AssertionSigner  # the gateway's signing key (to make a "captured" assertion)
    model: Path  # the model directory vllm serve runs
    config_file: Path  # the deployment's one file: cache, connector, gateway
    database_url: str
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> inference key
    log: Path = Path()
    spare: Spare | None = None  # started only when a test of two backends was collected


def serve_args(model: Path, port: int, config_file: Path) -> list[str]:
    """docs/gateway.md's ``vllm serve`` line with this machine's model, address and file, and
    the CPU flags after it."""
    args = vllm_serve_args("gateway.md")
    transfer = kv_transfer_config(args)
    assert transfer["kv_connector_extra_config"].keys() == {"config_file"}
    transfer["kv_connector_extra_config"] = {"config_file": str(config_file)}
    args[0] = str(model)
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    args[args.index("--kv-transfer-config") + 1] = json.dumps(transfer)
    return args + CPU_ARGS


def start_vllm(model: Path, port: int, config_file: Path, log: Path) -> subprocess.Popen[bytes]:
    """``vllm serve`` in a process group of its own (so that :func:`stop` ends its engine
    process too), its output in ``log``."""
    command = [sys.executable, "-m", "tests_engines.vllm_serve"]
    with log.open("wb") as out:
        return subprocess.Popen(
            command + serve_args(model, port, config_file),
            cwd=REPO,
            env={**os.environ, **VLLM_ENV},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_until_healthy(
    process: subprocess.Popen[bytes],
    url: str,
    log: Path,
    *,
    probe: str = "/health",
    name: str = "vllm serve",
) -> None:
    """Until ``url + probe`` answers 200 (``name`` for the failure, with its log's tail)."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            if httpx.get(url + probe, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-6000:]
    pytest.fail(f"{name} did not come up (exit {process.poll()}):\n{tail}", pytrace=False)


def stop(process: subprocess.Popen[bytes]) -> None:
    """End a process started in its own group (vllm serve and its engine, or the gateway)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def write_config(path: Path, root: Path, database_url: str, base: Path, **gateway: Any) -> None:
    """The deployment's one TOML file: the cache, the connector's ``[vllm]`` and ``[gateway]``
    (its ``backends`` and whatever else ``gateway`` gives)."""
    path.write_text(
        toml_text(
            {
                "cache": {"root": str(root), "database_url": database_url, "durable": False},
                "vllm": {
                    "gateway_public_keys": [str(base / "gateway.pub.pem")],
                    "audience": AUDIENCE,
                    "require_incarnation": True,
                },
                "gateway": {
                    "audience": AUDIENCE,
                    "secret_file": str(base / "secret"),
                    "signing_key_file": str(base / "gateway-key.pem"),
                    **gateway,
                },
            }
        ),
        encoding="utf-8",
    )


def stack_index(config: pytest.Config, request: pytest.FixtureRequest) -> Index:
    """PostgreSQL unless only SQLite was selected (see the module's docstring)."""
    if "postgresql" not in selected_index_kinds(config):
        return Index("sqlite", None)
    schemas: PostgresSchemas = request.getfixturevalue("postgres_schemas")
    schemas.connect()
    return Index("postgresql", schemas)


@pytest.fixture(scope="session")
def hosted_stack(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Stack]:
    from tests_engines.conftest import write_tiny_llama

    base = tmp_path_factory.mktemp("hosted")
    index = stack_index(request.config, request)
    model = write_tiny_tokenizer(write_tiny_llama(base / "tiny-llama"))
    root = base / "cache"
    database_url = index.url(root)
    signing = Ed25519PrivateKey.generate()
    (base / "gateway-key.pem").write_bytes(
        signing.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    )
    (base / "gateway.pub.pem").write_bytes(public_key_pem(signing.public_key()))
    (base / "secret").write_bytes(SECRET)
    port, spare_port = free_ports(2)  # the spare's start overlaps this one's
    vllm_url = f"http://127.0.0.1:{port}"
    config_file = base / "tenantkv.toml"  # one file for the cache, the connector, the gateway
    write_config(config_file, root, database_url, base, backends=[vllm_url])
    log = base / "vllm-serve.log"
    with tenantkv.open(root, durable=False, database_url=database_url) as kv:
        kv.create_tenant("acme")
        kv.create_tenant("globex")
        process = start_vllm(model, port, config_file, log)
        spare = None
        if any(item.path.name == "test_two_backends.py" for item in request.session.items):
            spare_log = base / "vllm-serve-spare.log"
            spare_process = start_vllm(model, spare_port, config_file, spare_log)
            spare = Spare(f"http://127.0.0.1:{spare_port}", spare_process, spare_log)
        try:
            wait_until_healthy(process, vllm_url, log)
            options = gateway_options(str(root), config_file=str(config_file))
            assert options.backends == (vllm_url,)
            with serving(build_gateway(kv, options, _authenticator)) as gateway_url:
                found = Stack(
                    gateway_url,
                    vllm_url,
                    kv,
                    AssertionSigner(signing),
                    model,
                    config_file,
                    database_url,
                    log=log,
                    spare=spare,
                )
                for tenant in ("acme", "globex"):
                    found.keys[tenant] = kv.inference_keys.create(tenant, "e2e")[1]
                yield found
        finally:
            stop(process)
            if spare is not None:
                stop(spare.process)
