"""Where an operator used to get a traceback, one sentence that names the problem (issue 37):
an index that does not answer, an index URL tenantkv does not run on, a root that is a file, an
engine integration imported without its extra, a bad port for ``tenantkv serve``."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import tenantkv
from tenantkv.cli import main
from tests.indexes import Index


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str, **env: str
) -> tuple[int, str]:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("command", ["upgrade", "current"])
def test_db_commands_with_postgresql_down_say_one_sentence(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    port = _dead_port()
    url = f"postgresql+psycopg://kv@127.0.0.1:{port}/kv"
    code, said = _run(capsys, monkeypatch, "db", command, str(tmp_path), TENANTKV_DATABASE_URL=url)
    assert code != 0
    assert said.startswith("tenantkv: opening the index at postgresql://kv@127.0.0.1:")
    assert "Connection refused" in said and "Traceback" not in said
    assert said.count("\n") == 1


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgres://kv:secret@db.example/kv", "write postgresql+psycopg://db.example/kv"),
        ("postgresql://kv@db.example/kv", "write postgresql+psycopg://db.example/kv"),
        ("mysql://kv@db.example/kv", "runs on SQLite (sqlite:///PATH) or PostgreSQL"),
    ],
)
def test_unsupported_index_urls_say_what_is_accepted(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    url: str,
    expected: str,
) -> None:
    code, said = _run(
        capsys, monkeypatch, "db", "current", str(tmp_path), TENANTKV_DATABASE_URL=url
    )
    assert code != 0 and expected in said, said
    assert "secret" not in said and "Traceback" not in said
    with pytest.raises(tenantkv.InvalidRequestError, match="is not supported"):
        tenantkv.CacheConfig(root=tmp_path, database_url=url)


def test_supported_index_urls_are_accepted(tmp_path: Path) -> None:
    """The positive control: the URLs the docs give pass the same check."""
    for url in (f"sqlite:///{tmp_path}/index.db", "postgresql+psycopg://kv@db.example/kv"):
        assert tenantkv.CacheConfig(root=tmp_path, database_url=url).database_url == url


def test_a_root_that_is_a_file_is_one_sentence(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    index: Index,
) -> None:
    file = tmp_path / "not-a-dir"
    file.write_text("x")
    for root in (file, file / "cache"):
        code, said = _run(capsys, monkeypatch, "init", str(root))
        assert code != 0 and "a file, not a directory" in said and "Traceback" not in said
    code, said = _run(capsys, monkeypatch, "init", str(tmp_path / "cache"))
    assert code == 0, said  # positive control: a directory root works


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: no permission to lose")
def test_a_root_that_is_not_writable_is_one_sentence(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    index: Index,
) -> None:
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o500)
    code, said = _run(capsys, monkeypatch, "init", str(parent / "cache"))
    assert code != 0 and "cannot be used" in said and "Traceback" not in said


@pytest.mark.parametrize(("module", "extra"), [("vllm", "vllm"), ("sglang", "sglang")])
def test_an_integration_without_its_extra_names_the_extra(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here (the engine venv tests the integration)")
    result = subprocess.run(
        [sys.executable, "-c", f"import tenantkv.integrations.{module}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and f"pip install 'tenantkv[{extra}]'" in last


def test_serve_refuses_a_bad_port_from_the_environment(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    index: Index,
) -> None:
    pytest.importorskip("fastapi")
    assert main(["init", str(tmp_path / "cache")]) == 0
    capsys.readouterr()
    code, said = _run(capsys, monkeypatch, "serve", str(tmp_path / "cache"), TENANTKV_PORT="abc")
    assert code == 2
    assert said.startswith("tenantkv serve: port = 'abc' is refused") and "TENANTKV_PORT" in said
    assert "Traceback" not in said
