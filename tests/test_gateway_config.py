"""The configuration file's ``[gateway]`` table: every key of the gateway (its
``GatewaySettings``, the backends, where it listens, the paths of its secret files) is
validated like every other section (unknown key, wrong type, bad URL, out of range: file,
line and field), and ``tenantkv gateway --config FILE`` serves the gateway the file describes,
with its flags over the file. The app is built by the command itself and served on loopback
in place of uvicorn's blocking loop, with the cache's real inference keys and a recording
backend, so what is checked is what reaches the backend."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

import tenantkv
from tenantkv.cli import main
from tenantkv.config import CacheConfig
from tenantkv.gateway import GatewayIdentity, GatewaySettings
from tenantkv.gateway.config_section import GatewayTable, load_gateway_table
from tenantkv.gateway.keyed import cache_salt
from tenantkv.integrations.engine_identity import ASSERTION_PARAM
from tenantkv.settings_file import ConfigFileError
from tenantkv.tenant_assertion import AssertionVerifier, TenantAssertionError
from tests.indexes import Index

from .gateway_stack import Recording, recording_backend, serving

SECRET = b"g" * 40
SIGNING = Ed25519PrivateKey.generate()

#: Every key of the table, each set away from its default (TOML text, then the loaded value).
FULL_TABLE: dict[str, tuple[str, Any]] = {
    "audience": ('"prod-eu"', "prod-eu"),
    "backends": (
        '["http://10.0.0.11:8000", "https://vllm-b.internal/v1base"]',
        ["http://10.0.0.11:8000", "https://vllm-b.internal/v1base"],
    ),
    "host": ('"0.0.0.0"', "0.0.0.0"),
    "port": ("9480", 9480),
    "secret_file": ('"{dir}/gateway.secret"', "{dir}/gateway.secret"),
    "signing_key_file": ('"{dir}/gateway-key.pem"', "{dir}/gateway-key.pem"),
    "assertion_lifetime": ("30.0", 30.0),
    "max_body_bytes": ("2097152", 2097152),
    "max_response_bytes": ("8388608", 8388608),
    "max_concurrency_per_key": ("8", 8),
    "max_connections": ("256", 256),
    "connect_timeout": ("1.5", 1.5),
    "upstream_timeout": ("90", 90),
    "health_timeout": ("0.5", 0.5),
    "backend_cooldown": ("10.0", 10.0),
    "affinity_chars": ("1024", 1024),
    "affinity_messages": ("3", 3),
    "log_format": ('"json"', "json"),
}


def _write(tmp_path: Path, text: str, name: str = "tenantkv.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_the_table_has_every_gateway_setting_with_its_default_and_type() -> None:
    """The table takes its tunables from ``GatewaySettings``: a field added there and
    forgotten here would be a setting the file cannot reach."""
    table = {f.name: f for f in dataclasses.fields(GatewayTable)}
    hints = typing.get_type_hints(GatewayTable)
    settings_hints = typing.get_type_hints(GatewaySettings)
    for f in dataclasses.fields(GatewaySettings):
        assert f.name in table, f"GatewaySettings.{f.name} is not a [gateway] key"
        if f.name != "audience":  # required there, may come from --audience here
            assert table[f.name].default == f.default
            assert hints[f.name] == settings_hints[f.name]
    assert set(FULL_TABLE) == set(table)  # the test below sets every key


def test_a_full_gateway_table_is_loaded_and_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _files(tmp_path)  # the secret files exist: the command reads them when it starts
    here = str(tmp_path)
    full = {
        key: (text.replace("{dir}", here), value.replace("{dir}", here))
        if isinstance(value, str)
        else (text, value)
        for key, (text, value) in FULL_TABLE.items()
    }
    lines = [f"{key} = {text}" for key, (text, _) in full.items()]
    path = _write(tmp_path, '[cache]\nroot = "/srv/kv"\n\n[gateway]\n' + "\n".join(lines) + "\n")
    table = load_gateway_table(path)
    for key, (_, value) in full.items():
        assert getattr(table, key) == value, key
    settings = table.settings()
    assert settings.audience == "prod-eu" and settings.max_body_bytes == 2097152
    assert table.missing() == []
    assert main(["config", "check", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {path} (cache, gateway)")
    # config show: the paths of the secret files are shown (they are not the secrets)
    assert main(["config", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert f'secret_file = "{tmp_path}/gateway.secret"  # file' in out
    assert f'signing_key_file = "{tmp_path}/gateway-key.pem"  # file' in out
    assert "affinity_messages = 3  # file" in out


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('audiance = "prod"', "gateway.audiance: unknown setting (did you mean 'audience'?)"),
        ('secret = "inline-secret-0123456789abcdef0123"', "gateway.secret: unknown setting"),
        ('port = "8480"', "gateway.port: expected an integer"),
        ("port = 70000", "gateway.port: port must be from 0 to 65535"),
        ('backends = "http://10.0.0.11:8000"', "gateway.backends: expected a list of strings"),
        ('backends = ["ftp://10.0.0.11"]', "gateway.backends: not a backend URL"),
        ('backends = ["http://u:pw@h:1"]', "gateway.backends: not a backend URL"),
        ("max_body_bytes = 12", "gateway.max_body_bytes: max_body_bytes must be a whole number"),
        ("upstream_timeout = 0", "gateway.upstream_timeout: upstream_timeout must be a finite"),
        ("assertion_lifetime = nan", "gateway.assertion_lifetime: assertion_lifetime must be"),
        ('audience = ""', "gateway.audience: audience must be a printable string"),
        ("secret_file = 12", "gateway.secret_file: expected a string"),
    ],
)
def test_a_bad_gateway_key_names_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, problem: str
) -> None:
    head = '# the gateway\n[gateway]\nhost = "127.0.0.1"\nmax_connections = 64\n'
    path = _write(tmp_path, head + line + "\n")
    with pytest.raises(ConfigFileError) as caught:
        load_gateway_table(path)
    assert caught.value.line == 5 and f"{path}, line 5: {problem}" in str(caught.value)
    assert "inline-secret" not in str(caught.value)
    assert main(["config", "check", str(path)]) == 2  # config check says the same
    assert f"{path}, line 5: {problem}" in capsys.readouterr().err
    # positive control: the table without the bad line is accepted
    good = _write(tmp_path, head, "good.toml")
    assert load_gateway_table(good).max_connections == 64
    assert main(["config", "check", str(good)]) == 0


def _files(tmp_path: Path) -> tuple[Path, Path]:
    secret = tmp_path / "gateway.secret"
    secret.write_bytes(SECRET)
    key = tmp_path / "gateway-key.pem"
    key.write_bytes(SIGNING.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    return secret, key


def _gateway_file(tmp_path: Path, backend: str, **extra: str) -> Path:
    secret, key = _files(tmp_path)
    values = {
        "audience": '"from-file"',
        "backends": f'["{backend}"]',
        "port": "9481",
        "secret_file": f'"{secret}"',
        "signing_key_file": f'"{key}"',
        "max_body_bytes": "4096",
        **extra,
    }
    text = f'[cache]\nroot = "{tmp_path / "cache"}"\n\n[gateway]\n'
    text += "".join(f"{k} = {v}\n" for k, v in values.items())
    return _write(tmp_path, text)


def _serve_once(seen: list[dict[str, Any]], key: str, body: dict[str, Any]) -> Any:
    """In place of ``uvicorn.run``: serve the app the command built on a free loopback port,
    send one request with ``key``, record the answer and where it was asked to listen."""

    def run(app: Any, *, host: str, port: int, log_level: str) -> None:
        with serving(app) as url, httpx.Client(base_url=url, timeout=10) as client:
            answer = client.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
        seen.append({"host": host, "port": port, "status": answer.status_code})

    return run


def test_cli_gateway_serves_what_the_file_describes(
    tmp_path: Path,
    index: Index,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import uvicorn

    rec = Recording("b0")
    with serving(recording_backend(rec)) as backend:
        path = _gateway_file(tmp_path, backend)
        assert main(["init", "--config", str(path)]) == 0
        with tenantkv.open(CacheConfig.from_env({}, config_file=path), create=False) as kv:
            kv.create_tenant("acme")
            info, key = kv.inference_keys.create("acme", "app", scope="alice")
            incarnation = kv.get_tenant("acme").incarnation
        seen: list[dict[str, Any]] = []
        monkeypatch.setattr(uvicorn, "run", _serve_once(seen, key, {"model": "m", "prompt": "hi"}))

        # the file alone: its backend, port, audience, secret and signing key
        assert main(["gateway", "--config", str(path)]) == 0, capsys.readouterr().err
        assert seen[-1] == {"host": "127.0.0.1", "port": 9481, "status": 200}
        sent = rec.requests[-1]["body"]
        assertion = sent["kv_transfer_params"][ASSERTION_PARAM]
        claims = AssertionVerifier([SIGNING.public_key()], audience="from-file").verify(assertion)
        assert (claims.tenant, claims.scope) == ("acme", "alice")
        identity = GatewayIdentity(info.id, "acme", "alice", incarnation)
        assert sent["cache_salt"] == cache_salt(SECRET, identity)  # keyed by the file's secret
        with pytest.raises(TenantAssertionError):  # the audience is the file's, no other
            AssertionVerifier([SIGNING.public_key()], audience="other").verify(assertion)

        # the file's limits are the gateway's: a body over its max_body_bytes is a 413
        big = _serve_once(seen, key, {"model": "m", "prompt": "x" * 5000})
        monkeypatch.setattr(uvicorn, "run", big)
        sent_before = len(rec.requests)
        assert main(["gateway", "--config", str(path)]) == 0
        assert seen[-1]["status"] == 413 and len(rec.requests) == sent_before

        # flags beat the file; TENANTKV_CONFIG names the file as --config does
        monkeypatch.setattr(uvicorn, "run", _serve_once(seen, key, {"model": "m", "prompt": "hi"}))
        monkeypatch.setenv("TENANTKV_CONFIG", str(path))
        assert main(["gateway", "--audience", "from-flag", "--port", "9482"]) == 0
        assert seen[-1] == {"host": "127.0.0.1", "port": 9482, "status": 200}
        assertion = rec.requests[-1]["body"]["kv_transfer_params"][ASSERTION_PARAM]
        verified = AssertionVerifier([SIGNING.public_key()], audience="from-flag").verify(assertion)
        assert verified.tenant == "acme"


def test_cli_gateway_refuses_an_incomplete_or_unreadable_configuration(
    tmp_path: Path,
    index: Index,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import uvicorn

    served: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(kw))
    path = _gateway_file(tmp_path, "http://127.0.0.1:8000")
    assert main(["init", "--config", str(path)]) == 0
    capsys.readouterr()
    # a secret file the table names that cannot be read: its line and field
    (tmp_path / "gateway.secret").unlink()
    assert main(["gateway", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}, line 8: gateway.secret_file: cannot read" in err
    # without a file, nothing says what to serve
    assert main(["gateway", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert "no audience, no backends, no secret_file, no signing_key_file" in err
    assert "--backend" in err and "[gateway]" in err
    # there are no TENANTKV_GATEWAY_* variables: one is refused, not silently ignored
    monkeypatch.setenv("TENANTKV_GATEWAY_PORT", "9999")
    assert main(["gateway", "--config", str(path)]) == 2
    assert "unknown tenantkv environment variable: TENANTKV_GATEWAY_PORT" in (
        capsys.readouterr().err
    )
    monkeypatch.delenv("TENANTKV_GATEWAY_PORT")
    assert served == []
    # positive control: the secret file back, the same command serves
    _files(tmp_path)
    assert main(["gateway", "--config", str(path)]) == 0
    assert served == [{"host": "127.0.0.1", "port": 9481, "log_level": "warning"}]
