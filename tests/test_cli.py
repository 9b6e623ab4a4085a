"""The command line: init, info and the walk-through (the README's main job) end to end."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tenantkv.cli import main
from tenantkv.services.tokens import hash_token
from tests.indexes import Index


def test_init_creates_index_and_private_key_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], index: Index
) -> None:
    root = tmp_path / "cache"
    assert main(["init", str(root)]) == 0
    out = capsys.readouterr().out
    assert "cache ready" in out and "schema_version" in out
    assert (root / "index.db").exists() == index.is_sqlite  # on PostgreSQL it is the server's
    assert stat.S_IMODE((root / "master.key").stat().st_mode) == 0o600
    token = out.strip().splitlines()[-1].strip()
    assert "first operator token" in out and token.startswith("tkv_")
    stored = index.stored_bytes(index.url(root))
    assert token.encode() not in stored  # stored only as a hash
    assert hash_token(token).encode() in stored  # positive control: the scan sees the row
    assert main(["init", str(root)]) == 0
    assert "first operator token" not in capsys.readouterr().out  # shown once only


@pytest.mark.usefixtures("index")
def test_info_reports_what_the_cache_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    assert main(["walkthrough", str(root), "--tokens", "256", "--layers", "2"]) == 0
    capsys.readouterr()
    assert main(["info", str(root), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tenant_names"] == ["acme", "globex"]
    assert info["blocks"] == 4 and info["cached_tokens"] == 256
    assert info["stored_bytes"] == 2 * 256 * 1152


@pytest.mark.usefixtures("index")
def test_info_on_a_missing_root_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", str(tmp_path / "nope")]) == 1
    assert "tenantkv init" in capsys.readouterr().err


def test_walkthrough_runs_as_a_command_and_cleans_up(tmp_path: Path, index: Index) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run(
        index.cli("walkthrough", "--tokens", "320", "--layers", "3"),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "walk-through passed"
    assert any("320 new tokens" in line for line in lines)
    assert any("192 tokens hit" in line for line in lines)
    assert any("globex looks up the same tokens: 0 tokens" in line for line in lines)
    assert list(tmp_path.iterdir()) == [], "the scratch cache was not removed"


@pytest.mark.usefixtures("index")
def test_wrong_master_key_is_a_clear_cli_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cache"
    assert main(["init", str(root)]) == 0
    monkeypatch.setenv("TENANTKV_MASTER_KEY", "00" * 32)
    assert main(["info", str(root)]) == 2
    assert "master key does not open" in capsys.readouterr().err
