"""The gateway's JSON logs (issue 37): ``tenantkv gateway --log-format json`` (or ``[gateway]
log_format``, or ``TENANTKV_LOG_FORMAT``) formats its lines as ``tenantkv serve`` does, and a
request carrying an inference key and a prompt leaves neither in them.

The command runs in a child process, as an operator starts it, with the cache's real inference
keys; its backend is a port nothing listens on, so serving the request logs a warning (the
positive control: the request did produce lines, and they are JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

import tenantkv
from tenantkv.cli.gateway import gateway_options
from tenantkv.errors import InvalidRequestError
from tests.indexes import _CLI_WITH_URL, Index
from tests.ports import free_ports

PROMPT = "You are a helpful assistant. The launch code is 7-4-1-9."


def _config_file(tmp_path: Path, backend: str, port: int, log_format: str | None) -> Path:
    secret = tmp_path / "gateway.secret"
    secret.write_bytes(b"s" * 32)
    key = tmp_path / "gateway-key.pem"
    private = Ed25519PrivateKey.generate()
    key.write_bytes(private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    lines = [
        "[gateway]",
        'audience = "logs-test"',
        f'backends = ["{backend}"]',
        f"port = {port}",
        f'secret_file = "{secret}"',
        f'signing_key_file = "{key}"',
    ]
    if log_format is not None:
        lines.append(f'log_format = "{log_format}"')
    path = tmp_path / "tenantkv.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_log_format_comes_from_the_flag_the_variable_or_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TENANTKV_LOG_FORMAT", raising=False)
    root = str(tmp_path / "kv")
    plain = _config_file(tmp_path, "http://127.0.0.1:9", 8480, None)
    assert gateway_options(root, str(plain)).log_format == "text"  # the default
    path = _config_file(tmp_path, "http://127.0.0.1:9", 8480, "json")
    assert gateway_options(root, str(path)).log_format == "json"  # the file
    monkeypatch.setenv("TENANTKV_LOG_FORMAT", "text")
    assert gateway_options(root, str(path)).log_format == "text"  # the variable over the file
    assert gateway_options(root, str(path), log_format="json").log_format == "json"  # the flag
    monkeypatch.setenv("TENANTKV_LOG_FORMAT", "xml")
    with pytest.raises(InvalidRequestError, match="log_format must be one of text, json"):
        gateway_options(root, str(path))


def test_json_logs_of_a_served_request_carry_no_key_and_no_prompt(
    tmp_path: Path, index: Index
) -> None:
    root = tmp_path / "kv"
    with tenantkv.open(root, durable=False) as kv:
        kv.create_tenant("acme")
        _, key = kv.inference_keys.create("acme", "app")
    dead_port, port = free_ports(2)  # a backend nothing listens on, and the gateway's
    dead = f"http://127.0.0.1:{dead_port}"
    config = _config_file(tmp_path, dead, port, log_format=None)
    env = {k: v for k, v in os.environ.items() if k != "TENANTKV_LOG_FORMAT"}
    env["TENANTKV_CONFIG"] = str(config)
    env["PYTHONPATH"] = str(Path(__file__).parents[1])
    command = [sys.executable, "-c", _CLI_WITH_URL, index.url(root)]
    command += ["gateway", str(root), "--log-format", "json"]
    child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            deadline = time.monotonic() + 60
            while True:
                assert child.poll() is None, child.communicate()[1].decode()
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.2)
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
            served = client.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            refused = client.post(
                "/v1/completions", json=body, headers={"Authorization": "Bearer tkvi_" + "x" * 43}
            )
    finally:
        child.terminate()
        _, err = child.communicate(timeout=30)
    assert served.status_code == 502 and "upstream_unreachable" in served.text
    assert refused.status_code == 401  # the key was checked: the served request was acme's
    output = err.decode()
    lines = [json.loads(line) for line in output.splitlines() if line.strip()]  # JSON, all
    unreachable = [line for line in lines if "could not be reached" in line["message"]]
    assert unreachable, output  # positive control: serving the request logged a line
    assert {"time", "level", "logger", "message"} <= set(unreachable[0])
    assert unreachable[0]["level"] == "WARNING" and dead in unreachable[0]["message"]
    for secret in (key, PROMPT, "launch code", "7-4-1-9", "tkvi_"):
        assert secret not in output
