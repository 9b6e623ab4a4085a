"""The serving recipe as the docs show it: docs/deploy.md's full configuration file passes
``tenantkv config check`` as written; the ``vllm serve --kv-transfer-config`` line is the same
in docs/engines.md and docs/gateway.md, names the connector class the package exports, and
points its extra config at that file; the documented request body, sent through a gateway built
from the file's ``[gateway]`` table with a real inference key, reaches the backend as the docs
say vLLM receives it. vLLM's own parsing of the line and the connector's parsing of its extra
config need vLLM: ``tests_engines/test_vllm_recipe.py`` (the engine venv)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

import tenantkv
from tenantkv.cli import main
from tenantkv.cli.gateway import _authenticator, build_gateway, gateway_options
from tenantkv.integrations.engine_identity import ASSERTION_PARAM
from tenantkv.tenant_assertion import AssertionVerifier
from tests.doc_recipes import (
    curl_body,
    deploy_example,
    fenced_blocks,
    kv_transfer_config,
    toml_text,
    vllm_serve_args,
)
from tests.indexes import Index

from .gateway_stack import Recording, recording_backend, serving

PACKAGE = Path(tenantkv.__file__).resolve().parent
FILE_PATH = "/etc/tenantkv/tenantkv.toml"  # where docs/deploy.md's example says it lives


def test_the_deploy_example_passes_config_check_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, tables = deploy_example()
    assert text.startswith(f"# {FILE_PATH}\n")
    assert {"cache", "server", "vllm", "gateway"} <= set(tables)
    path = tmp_path / "tenantkv.toml"
    path.write_text(text, encoding="utf-8")
    assert main(["config", "check", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith(f"ok: {path} (cache, server, gateway)")  # [vllm]: the engine venv
    # the gateway signs for the audience the connector verifies
    assert tables["gateway"]["audience"] == tables["vllm"]["audience"]
    # control: the same file with one key misspelt is refused, naming it
    path.write_text(text.replace("upstream_timeout", "upstream_timout"), encoding="utf-8")
    assert main(["config", "check", str(path)]) == 2
    assert "gateway.upstream_timout: unknown setting" in capsys.readouterr().err


def _exported_class(name: str) -> bool:
    """Whether ``tenantkv.integrations.vllm`` exports a class ``name`` defined in one of its
    modules (read from the source: importing it needs vLLM)."""
    package = PACKAGE / "integrations" / "vllm"
    init = ast.parse((package / "__init__.py").read_text(encoding="utf-8"))
    exported: list[str] = []
    for node in init.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            exported = list(ast.literal_eval(node.value))
    defined = {
        node.name
        for module in package.glob("*.py")
        for node in ast.parse(module.read_text(encoding="utf-8")).body
        if isinstance(node, ast.ClassDef)
    }
    return name in exported and name in defined


def test_the_vllm_serve_recipe_names_the_connector_and_the_file() -> None:
    args = vllm_serve_args("engines.md")
    assert vllm_serve_args("gateway.md") == args  # one recipe, the same on both pages
    config = kv_transfer_config(args)
    assert set(config) == {
        "kv_connector",
        "kv_connector_module_path",
        "kv_role",
        "kv_load_failure_policy",
        "kv_connector_extra_config",
    }
    assert config["kv_connector_module_path"] == "tenantkv.integrations.vllm"
    assert _exported_class(config["kv_connector"])
    assert not _exported_class(config["kv_connector"] + "X")  # control: the check can fail
    assert config["kv_role"] == "kv_both" and config["kv_load_failure_policy"] == "recompute"
    # the connector reads the deployment's file, and only it
    assert config["kv_connector_extra_config"] == {"config_file": FILE_PATH}
    assert "--disable-hybrid-kv-cache-manager" in args  # the connector needs one KV group
    assert "--enable-prompt-tokens-details" in args  # usage then shows cached tokens
    # the gateway of the same file routes to this server
    _, tables = deploy_example()
    host, port = args[args.index("--host") + 1], args[args.index("--port") + 1]
    assert f"http://{host}:{port}" in tables["gateway"]["backends"]


def _gateway_file(tmp_path: Path, backend: str, signing: Ed25519PrivateKey) -> Path:
    """docs/deploy.md's ``[gateway]`` table as written, but for its backends and its two files
    (here a recording backend and files made for the test), with a test cache."""
    _, tables = deploy_example()
    secret = tmp_path / "gateway.secret"
    secret.write_bytes(b"r" * 32)
    key = tmp_path / "gateway-key.pem"
    key.write_bytes(signing.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    gateway = {
        **tables["gateway"],
        "backends": [backend],
        "secret_file": str(secret),
        "signing_key_file": str(key),
    }
    path = tmp_path / "tenantkv.toml"
    path.write_text(toml_text({"cache": {"root": str(tmp_path / "kv")}, "gateway": gateway}))
    return path


def test_the_documented_request_reaches_vllm_as_documented(tmp_path: Path, index: Index) -> None:
    body = curl_body("engines.md")
    assert curl_body("gateway.md") == body
    (forwarded_doc,) = [json.loads(b) for b in fenced_blocks("engines.md", "json")]
    signing = Ed25519PrivateKey.generate()
    rec = Recording("vllm")
    with serving(recording_backend(rec)) as backend:
        path = _gateway_file(tmp_path, backend, signing)
        options = gateway_options(str(tmp_path / "kv"), str(path))
        with tenantkv.open(options.root, durable=False) as kv:
            kv.create_tenant("acme")
            _, key = kv.inference_keys.create("acme", "app")
            app = build_gateway(kv, options, _authenticator)
            with serving(app) as url, httpx.Client(base_url=url, timeout=10) as client:
                answer = client.post(
                    "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )
                refused = client.post(
                    "/v1/completions", json=body, headers={"Authorization": "Bearer tkvi_x"}
                )
    assert answer.status_code == 200, answer.text
    assert refused.status_code == 401 and len(rec.requests) == 1  # control: keys are checked
    sent: dict[str, Any] = rec.requests[0]["body"]
    assert set(sent) == set(forwarded_doc)  # the fields the docs say vLLM receives, no other
    assert {k: sent[k] for k in body} == body  # the client's body, unchanged
    assert isinstance(sent["cache_salt"], str) and len(sent["cache_salt"]) >= 32
    assert set(sent["kv_transfer_params"]) == set(forwarded_doc["kv_transfer_params"])
    assertion = sent["kv_transfer_params"][ASSERTION_PARAM]
    assert assertion.startswith("tkva1.")
    _, tables = deploy_example()
    verifier = AssertionVerifier([signing.public_key()], audience=tables["vllm"]["audience"])
    assert verifier.verify(assertion).tenant == "acme"  # what the connector will accept
    assert "kv_transfer_params" not in answer.json()  # and the client never sees it
