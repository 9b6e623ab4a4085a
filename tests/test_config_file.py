"""The configuration file: each problem names its file, line and field; environment > file >
defaults; secrets masked; the CLI's ``config check`` / ``config show``; commands open the cache
the file names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenantkv.cli import main
from tenantkv.config import CacheConfig
from tenantkv.errors import InvalidRequestError
from tenantkv.settings_file import ConfigFileError, key_line, mask
from tests.indexes import Index

INT_FIELDS = ["load_workers", "seal_workers", "staging_bytes", "lookup_cache_keys", "window"]


def _write(tmp_path: Path, text: str, name: str = "tenantkv.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _error(path: Path, **env: str) -> ConfigFileError:
    with pytest.raises(ConfigFileError) as caught:
        CacheConfig.from_env(env, config_file=path)
    return caught.value


def _layouts(field: str, bad: str) -> dict[str, list[str]]:
    """The ways a file may set ``cache.<field>``: the key is always on the last line."""
    return {
        "table": ["[cache]", 'root = "/srv/kv"', f"{field} = {bad}"],
        "spaced": ["[cache]", f"  {field}   =   {bad}   # spaced"],
        "quoted": ['["cache"]', f'"{field}" = {bad}'],
        "dotted": [f"cache.{field} = {bad}"],
        "inline": [f"cache = {{ root = '/srv/kv', {field} = {bad} }}"],
    }


#: What may come before: nothing, blank lines and comments, another table, and a multi-line
#: string holding text that looks like the key (which must not be taken for it).
PREAMBLES = {
    "none": [],
    "comments": ["", "# a comment", ""],
    "table": ["[server]", "port = 8470"],
    "string": ["[vllm]", 'audience = """', "[cache]", "load_workers = 1", '"""'],
}


@settings(max_examples=80, deadline=None)
@given(
    field=st.sampled_from(INT_FIELDS),
    layout=st.sampled_from(["table", "spaced", "quoted", "dotted", "inline"]),
    preamble=st.sampled_from(sorted(PREAMBLES)),
    bad=st.sampled_from(['"many"', "true", "1.5", "[1]"]),
)
def test_a_wrong_type_names_file_line_and_field(
    tmp_path_factory: pytest.TempPathFactory, field: str, layout: str, preamble: str, bad: str
) -> None:
    before = PREAMBLES[preamble]
    if layout in ("dotted", "inline") and preamble in ("table", "string"):
        before = []  # a top-level key after a table header would belong to that table
    lines = [*before, *_layouts(field, bad)[layout]]
    path = _write(tmp_path_factory.mktemp("cfg"), "\n".join(lines) + "\n")
    err = _error(path)
    assert err.file == str(path) and err.field == f"cache.{field}"
    assert err.line == len(lines)  # the key's line, the last one written
    assert f"{path}, line {len(lines)}: cache.{field}: expected an integer" in str(err)


def test_unknown_key_and_unknown_section_name_their_line(tmp_path: Path) -> None:
    path = _write(tmp_path, '[cache]\nroot = "/srv/kv"\n\nload_wokers = 4\n')
    err = _error(path)
    assert (err.line, err.field) == (4, "cache.load_wokers")
    assert "unknown setting (did you mean 'load_workers'?)" in str(err)
    path = _write(tmp_path, "[cache]\nstrict = true\n\n[servre]\nport = 1\n")
    err = _error(path)
    assert (err.line, err.field) == (4, "servre") and "unknown section" in str(err)
    # positive control: the same keys spelt right are accepted
    path = _write(tmp_path, '[cache]\nroot = "/srv/kv"\nload_workers = 4\n[server]\nport = 1\n')
    assert CacheConfig.from_env({}, config_file=path).load_workers == 4


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("database_url", "mysql://kv:pw@db/kv", "must be sqlite"),
        ("database_url", "postgresql+psycopg://kv@db:port/kv", "not a valid URL"),
        ("database_url", "/var/lib/kv/index.db", "not a URL"),
        ("block_store_url", "s3://bucket/kv", "unsupported block store"),
        ("block_store_url", "redis://h:6379/0,mnt/kv", "not a URL"),
    ],
)
def test_a_bad_url_names_its_line_and_field(
    tmp_path: Path, key: str, value: str, problem: str
) -> None:
    path = _write(tmp_path, f'# urls\n[cache]\nstrict = false\n{key} = "{value}"\n')
    err = _error(path)
    assert (err.line, err.field) == (4, f"cache.{key}") and problem in str(err)
    assert "pw" not in str(err)  # a refused URL's password is not echoed


def test_a_value_out_of_range_names_its_field(tmp_path: Path) -> None:
    path = _write(tmp_path, "[cache]\nlease_seconds = 60\nstaging_bytes = 0\n")
    err = _error(path)
    assert (err.line, err.field) == (3, "cache.staging_bytes") and "positive" in str(err)
    path = _write(tmp_path, "[server]\nport = 70000\n")
    assert main(["config", "check", str(path)]) == 2


def test_precedence_environment_over_file_over_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path, '[cache]\nroot = "/srv/file"\nload_workers = 3\nstrict = true\n')
    config = CacheConfig.from_env({"TENANTKV_LOAD_WORKERS": "7"}, config_file=path)
    assert config.load_workers == 7  # environment beats the file
    assert config.strict is True and config.root == Path("/srv/file")  # file beats defaults
    assert config.lease_seconds == CacheConfig().lease_seconds  # defaults elsewhere
    # the file named by TENANTKV_CONFIG is read the same way
    via_env = CacheConfig.from_env({"TENANTKV_CONFIG": str(path)})
    assert via_env.load_workers == 3 and via_env.strict is True
    # an environment value overriding a file value is not the file's fault
    with pytest.raises(Exception, match="not a number") as caught:
        CacheConfig.from_env({"TENANTKV_LOAD_WORKERS": "x"}, config_file=path)
    assert not isinstance(caught.value, ConfigFileError)


def test_server_settings_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tenantkv.server.settings import load_settings

    path = _write(tmp_path, "[server]\nport = 8555\nmax_body_bytes = 4096\n")
    settings = load_settings(path)
    assert settings.port == 8555 and settings.max_body_bytes == 4096
    assert settings.host == "127.0.0.1"  # default
    monkeypatch.setenv("TENANTKV_PORT", "8666")
    assert load_settings(path).port == 8666  # environment beats the file
    assert load_settings(path, port=8777).port == 8777  # a command-line flag beats both
    path = _write(tmp_path, '[server]\nport = "8555"\n', "bad.toml")
    with pytest.raises(ConfigFileError, match=r"bad.toml, line 2: server.port: expected an integ"):
        load_settings(path)


def test_masking_hides_passwords_and_secret_fields() -> None:
    url = "postgresql+psycopg://tkv:s3cret@db:5432/tkv?application_name=n1&password=p4ss"
    shown = mask("database_url", url)
    assert "s3cret" not in shown and "p4ss" not in shown
    assert shown.startswith("postgresql+psycopg://tkv:***@db:5432/tkv") and "n1" in shown
    tiers = mask("block_store_url", "redis://:r3dis@cache:6379/0?prefix=tkv,file:///mnt/kv")
    assert "r3dis" not in tiers and tiers.endswith(",file:///mnt/kv") and "prefix=tkv" in tiers
    assert mask("gateway_secret", "k3y") == "***" and mask("signing_key", "pem") == "***"
    assert mask("max_token_ttl_seconds", 60) == 60  # not a secret: shown
    assert mask("database_url", "sqlite:////srv/kv/index.db") == "sqlite:////srv/kv/index.db"


def test_key_line_finds_tables_dotted_keys_and_skips_strings() -> None:
    text = "\n".join(
        [
            'note = """',
            "[cache]",
            "root = 'inside a string'",
            '"""',
            "[server.limits]",
            "x = 1",
            "[cache]",
            "  'root' = '/srv'",
            "a.b.c = 2",
        ]
    )
    assert key_line(text, ("cache", "root")) == 8
    assert key_line(text, ("cache", "a", "b", "c")) == 9
    assert key_line(text, ("server", "limits", "x")) == 6
    assert key_line(text, ("cache",)) == 7


def test_cli_config_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path, '[cache]\nroot = "/srv/kv"\n[server]\nport = 8471\n')
    assert main(["config", "check", str(good)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {good} (cache, server)")
    bad = _write(tmp_path, '[cache]\nroot = "/srv/kv"\n[server]\nprot = 8471\n', "bad.toml")
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}, line 4: server.prot: unknown setting (did you mean 'port'?)" in err
    assert main(["config", "check", str(tmp_path / "missing.toml")]) == 2
    assert "cannot be read" in capsys.readouterr().err
    broken = _write(tmp_path, "[cache\n", "broken.toml")
    assert main(["config", "check", str(broken)]) == 2
    assert "line 1" in capsys.readouterr().err


def test_cli_config_show_masks_and_says_where_each_value_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(
        tmp_path,
        "[cache]\n"
        'database_url = "postgresql+psycopg://tkv:hunter2@db:5432/tkv"\n'
        "load_workers = 3\n[server]\nport = 8471\n",
    )
    monkeypatch.setenv("TENANTKV_LOAD_WORKERS", "5")
    assert main(["config", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out
    assert 'database_url = "postgresql+psycopg://tkv:***@db:5432/tkv"  # file' in out
    assert "load_workers = 5  # env TENANTKV_LOAD_WORKERS" in out
    assert "port = 8471  # file" in out and 'host = "127.0.0.1"  # default' in out
    monkeypatch.setenv("TENANTKV_CONFIG", str(path))  # show with no argument reads it
    assert main(["config", "show"]) == 0
    assert "port = 8471  # file" in capsys.readouterr().out


def test_info_opens_the_cache_the_file_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], index: Index
) -> None:
    root = tmp_path / "from-file"
    database = index.database_url(tmp_path / "elsewhere.db")
    path = _write(tmp_path, f'[cache]\nroot = "{root}"\ndatabase_url = "{database}"\n')
    assert main(["init", "--config", str(path)]) == 0  # creates the cache the file names
    capsys.readouterr()
    assert main(["info", "--json", "--config", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert Path(info["root"]).resolve() == root.resolve()
    assert (tmp_path / "elsewhere.db").exists() == index.is_sqlite
    # the same through TENANTKV_CONFIG, and `tenantkv --config F info` before the command
    assert main(["--config", str(path), "info", "--json"]) == 0
    assert Path(json.loads(capsys.readouterr().out)["root"]).resolve() == root.resolve()
    # a file with a misspelt key stops the command, naming the line
    bad = _write(tmp_path, f'[cache]\nroot = "{root}"\ndatabse_url = "{database}"\n', "bad.toml")
    assert main(["info", "--config", str(bad)]) == 2
    assert "bad.toml, line 3: cache.databse_url: unknown setting" in capsys.readouterr().err


def test_serve_uses_the_file(tmp_path: Path, index: Index, monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve --config`` hands the server the file's [server] table and the root its [cache]
    names; the server's own cache is then opened for real. Only uvicorn's loop is replaced."""
    import tenantkv
    import tenantkv.server.app as app

    root = tmp_path / "served"
    path = _write(tmp_path, f'[cache]\nroot = "{root}"\n[server]\nport = 8599\n')
    assert main(["init", "--config", str(path)]) == 0
    seen: list[object] = []
    monkeypatch.setattr(app, "run", seen.append)
    assert main(["serve", "--config", str(path)]) == 0
    (settings,) = seen
    assert settings.port == 8599 and Path(settings.root) == root  # type: ignore[attr-defined]
    with tenantkv.open(settings.cache_config(), create=False) as kv:  # type: ignore[attr-defined]
        assert Path(kv.info()["root"]).resolve() == root.resolve()
    assert main(["serve", "--config", str(path), "--port", "8600"]) == 0
    assert seen[-1].port == 8600  # type: ignore[attr-defined]


def test_connector_reads_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")  # run in the engine venv (scripts/test_engines.sh); skipped here
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tenantkv.integrations.vllm.settings import ConnectorSettings

    pem = tmp_path / "gateway.pub.pem"
    pem.write_bytes(
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    path = _write(
        tmp_path,
        f'[cache]\nroot = "{tmp_path / "kv"}"\nload_workers = 3\n'
        f'[vllm]\ngateway_public_keys = ["{pem}"]\naudience = "prod"\nload_async = true\n'
        'codec = "fp8"\n',
    )
    settings = ConnectorSettings.from_extra_config({"config_file": str(path)}, "m")
    assert settings.root == str(tmp_path / "kv") and settings.audience == "prod"
    assert settings.open_options["load_workers"] == 3 and settings.load_async is True
    assert settings.gateway_public_keys == (pem.read_bytes(),) and settings.model == "m"
    assert settings.codec == "fp8" and settings.layer_wise is True  # the default
    for raw, taken in (('"auto"', None), ("false", False), ("true", True)):
        mode = _write(
            tmp_path, f'[vllm]\ngateway_public_keys = ["{pem}"]\nlayer_wise = {raw}\n', "l.toml"
        )
        assert ConnectorSettings.from_extra_config({"config_file": str(mode)}, "m").layer_wise is (
            taken
        )
    odd = _write(
        tmp_path, f'[vllm]\ngateway_public_keys = ["{pem}"]\nlayer_wise = "no"\n', "o.toml"
    )
    with pytest.raises(ConfigFileError, match="layer_wise must be true, false or"):
        ConnectorSettings.from_extra_config({"config_file": str(odd)}, "m")
    unknown = _write(
        tmp_path, f'[vllm]\ngateway_public_keys = ["{pem}"]\ncodec = "nf4"\n', "c.toml"
    )
    with pytest.raises(ConfigFileError, match="unknown codec 'nf4'"):
        ConnectorSettings.from_extra_config({"config_file": str(unknown)}, "m")
    with pytest.raises(InvalidRequestError, match="unknown codec 'nf4'"):
        ConnectorSettings.from_extra_config(
            {"root": "/x", "gateway_public_keys": [str(pem)], "codec": "nf4"}, "m"
        )
    monkeypatch.setenv("TENANTKV_LOAD_WORKERS", "4")  # the environment beats the file here too
    assert (
        ConnectorSettings.from_extra_config({"config_file": str(path)}, "m").open_options[
            "load_workers"
        ]
        == 4
    )
    with pytest.raises(Exception, match="not beside it"):
        ConnectorSettings.from_extra_config({"config_file": str(path), "root": "/x"}, "m")
    missing = _write(tmp_path, '[vllm]\ngateway_public_keys = ["/nonexistent.pem"]\n', "m.toml")
    with pytest.raises(ConfigFileError, match=r"m.toml, line 2: vllm.gateway_public_keys"):
        ConnectorSettings.from_extra_config({"config_file": str(missing)}, "m")
