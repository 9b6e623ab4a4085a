"""The bootstrap operator token and its recovery: shown once, by the ``init`` that creates the
index, with an expiry; never printed by ``serve`` (whose output goes to logs); recovered on the
host with ``tenantkv token recover``, to a terminal or a new 0600 file, audited."""

from __future__ import annotations

import json
import os
import pty
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import tenantkv
from tenantkv.cli import main
from tenantkv.server.app import create_app
from tenantkv.server.settings import Settings
from tenantkv.services.tokens import BOOTSTRAP_TTL_SECONDS, token_id_of
from tests.indexes import Index
from tests.serving import cli_env, run_serve

TOKEN = re.compile(r"tkv_[A-Za-z0-9_-]{43}")


def init(root: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str | None:
    """``tenantkv init root``; the token it showed, if any."""
    assert main(["init", str(root), *extra]) == 0
    found = TOKEN.findall(capsys.readouterr().out)
    assert len(found) <= 1
    return found[0] if found else None


def operator_ids(root: Path) -> list[str]:
    with tenantkv.open(root, create=False) as kv:
        return sorted(info.id for info in kv.tokens.listing() if info.role == "operator")


def revoke_every_operator(root: Path) -> None:
    with tenantkv.open(root, create=False) as kv:
        for info in kv.tokens.listing():
            if info.role == "operator":
                assert kv.tokens.revoke(info.id)


def admin_api_status(root: Path, token: str) -> int:
    """The status of ``GET /v1/tenants`` with ``token``, from the admin API over ``root``."""
    with tenantkv.open(root, create=False) as kv, TestClient(create_app(kv, Settings())) as api:
        headers = {"Authorization": f"Bearer {token}"}
        return api.get("/v1/tenants", headers=headers).status_code


def recovery_records(root: Path) -> list[dict[str, object]]:
    with tenantkv.open(root, create=False) as kv:
        lines = map(json.loads, kv.audit.export(tenant=None))
        return [
            r
            for r in lines
            if r.get("action") == "token.create"
            and r.get("details", {}).get("purpose") == "recovery"
        ]


def test_serve_on_an_index_whose_operators_are_all_revoked_prints_no_token(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    first = init(root, capsys)
    assert first is not None  # control: the creating init did show the bootstrap token
    revoke_every_operator(root)
    run = run_serve(root, index.url(root))
    assert run.served, run.output  # positive control: the server did start and serve
    assert TOKEN.search(run.output) is None, run.output
    assert "operator token" not in run.output
    assert operator_ids(root) == [token_id_of(first)]  # and it made none unseen either


def test_the_bootstrap_token_shown_at_creation_expires(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str]
) -> None:
    before = time.time()
    token = init(tmp_path / "a", capsys)
    assert token is not None
    with tenantkv.open(tmp_path / "a", create=False) as kv:
        expires = kv.tokens.authenticate(token).expires_at
    assert expires is not None
    assert before + BOOTSTRAP_TTL_SECONDS <= expires <= time.time() + BOOTSTRAP_TTL_SECONDS
    short = init(tmp_path / "b", capsys, "--token-ttl", "600")  # configurable
    assert short is not None
    with tenantkv.open(tmp_path / "b", create=False) as kv:
        expires = kv.tokens.authenticate(short).expires_at
    assert expires is not None and before + 600 <= expires <= time.time() + 600
    assert main(["init", str(tmp_path / "c"), "--token-ttl", "0"]) == 2
    assert not (tmp_path / "c").exists()  # refused before anything was made


def test_init_shows_a_token_only_when_it_creates_the_index(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str]
) -> None:
    made_by_library = tmp_path / "library"
    tenantkv.open(made_by_library).close()  # a cache with no operator token yet
    assert init(made_by_library, capsys) is None
    assert operator_ids(made_by_library) == []
    created = tmp_path / "created"
    assert init(created, capsys) is not None  # positive control
    revoke_every_operator(created)
    assert init(created, capsys) is None  # revoked: recovered, never re-shown


def test_token_recover_writes_a_private_file_with_a_working_token(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    first = init(root, capsys)
    assert first is not None
    revoke_every_operator(root)
    assert admin_api_status(root, first) == 401  # control: the API refuses a revoked token
    out = tmp_path / "operator.token"
    before = time.time()
    assert main(["token", "recover", str(root), "--out", str(out)]) == 0
    streams = capsys.readouterr()
    assert TOKEN.search(streams.out + streams.err) is None  # only the file holds it
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    token = out.read_text().strip()
    assert TOKEN.fullmatch(token)
    assert admin_api_status(root, token) == 200  # it authenticates against the admin API
    with tenantkv.open(root, create=False) as kv:
        principal = kv.tokens.authenticate(token)
    assert principal.role == "operator" and principal.expires_at is not None
    assert before + BOOTSTRAP_TTL_SECONDS <= principal.expires_at
    (record,) = recovery_records(root)
    assert record["target"] == token_id_of(token)
    assert str(record["actor"]).startswith("cli:")


def test_token_recover_refuses_a_pipe_and_an_existing_file(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    assert init(root, capsys) is not None
    assert main(["token", "recover", str(root)]) == 2  # captured stdout is not a terminal
    streams = capsys.readouterr()
    assert TOKEN.search(streams.out + streams.err) is None and "--out" in streams.err
    existing = tmp_path / "taken"
    existing.write_text("keep me\n")
    assert main(["token", "recover", str(root), "--out", str(existing)]) == 2
    assert existing.read_text() == "keep me\n"
    capsys.readouterr()
    assert recovery_records(root) == []  # neither refusal minted a token
    fresh = tmp_path / "fresh.token"
    assert main(["token", "recover", str(root), "--out", str(fresh), "--ttl", "60"]) == 0
    assert len(recovery_records(root)) == 1  # positive control


def test_token_recover_prints_to_a_terminal(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    assert init(root, capsys) is not None
    leader, follower = pty.openpty()
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "tenantkv.cli", "token", "recover", str(root)],
            stdout=follower,
            stderr=subprocess.PIPE,
            env=cli_env(index.url(root)),
        )
        os.close(follower)
        follower = -1
        printed = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            printed += chunk
        _, err = child.communicate(timeout=120)
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert child.returncode == 0, err
    (token,) = TOKEN.findall(printed.decode())
    assert TOKEN.search(err.decode()) is None
    assert admin_api_status(root, token) == 200
