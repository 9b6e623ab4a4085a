"""A ``TENANTKV_*`` variable no component reads is refused at start: a misspelt
``TENANTKV_DATABSE_URL`` used to be ignored, and a fleet node then ran on its own SQLite index."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tenantkv
from tenantkv.cli import main
from tenantkv.config import CacheConfig


def test_a_misspelt_variable_is_refused_by_from_env() -> None:
    env = {"TENANTKV_DATABSE_URL": "postgresql+psycopg://kv@db/kv", "TENANTKV_ROOT": "/srv/kv"}
    with pytest.raises(tenantkv.InvalidRequestError, match="TENANTKV_DATABSE_URL") as caught:
        CacheConfig.from_env(env)
    assert "did you mean TENANTKV_DATABASE_URL" in str(caught.value)
    # positive control: the right name is read, and other programs' variables are left alone
    env = {"TENANTKV_DATABASE_URL": "postgresql+psycopg://kv@db/kv", "TENANTKVX": "1", "PATH": "/"}
    assert CacheConfig.from_env(env).database_url == "postgresql+psycopg://kv@db/kv"


@pytest.mark.usefixtures("index")
def test_a_misspelt_variable_stops_a_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENANTKV_LOAD_WORKRES", "4")
    assert main(["info", str(tmp_path / "nope")]) == 2
    assert "TENANTKV_LOAD_WORKRES (did you mean TENANTKV_LOAD_WORKERS?)" in capsys.readouterr().err
    monkeypatch.delenv("TENANTKV_LOAD_WORKRES")
    monkeypatch.setenv("TENANTKV_LOAD_WORKERS", "4")  # control: the right name gets past it
    assert main(["info", str(tmp_path / "nope")]) == 1  # the missing root's own error
    assert "tenantkv init" in capsys.readouterr().err


def test_the_allow_list_names_every_variable_of_the_projects_scripts() -> None:
    """A script's own switch (``TENANTKV_SKIP_GPU_CHECK=1 bash scripts/test.sh``) stays in the
    environment of every command the script runs: unlisted, it made each CLI command the tests
    start refuse to run."""
    from tenantkv.config import known_environment

    repo = Path(__file__).resolve().parents[1]
    scripts = [*repo.glob("scripts/*.sh"), *repo.glob("bench/**/*.sh"), repo / ".ci" / "run"]
    named = {
        name
        for script in scripts
        if script.is_file()
        for name in re.findall(r"TENANTKV_[A-Z0-9_]+", script.read_text(encoding="utf-8"))
    }
    assert "TENANTKV_SKIP_GPU_CHECK" in named  # the scan finds the scripts' variables
    assert named - known_environment() == set()


def test_the_allow_list_names_every_server_setting() -> None:
    """The server's variables are listed statically (the server is an optional extra): the list
    must follow its settings, or a new server setting would be refused by the CLI."""
    pytest.importorskip("pydantic_settings")
    from tenantkv.config import SERVER_ENV_FIELDS, known_environment
    from tenantkv.server.settings import Settings

    assert set(Settings.model_fields) - {"root"} == SERVER_ENV_FIELDS
    assert {"TENANTKV_PORT", "TENANTKV_ROOT", "TENANTKV_MASTER_KEY", "TENANTKV_CONFIG"} <= (
        known_environment()
    )
