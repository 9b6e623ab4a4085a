"""A root that holds no cache (a mistyped path, an empty directory) is refused by every command
but ``init`` and the demos, with one sentence and a non-zero exit, and nothing is created there;
an opening that fails before a cache exists leaves nothing behind. The library creates a cache
only when asked to (``open(create=True)``, its default)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tenantkv
from tenantkv import CacheNotFoundError, CacheUnavailableError, MasterKeyError
from tenantkv.cli import main
from tests.indexes import Index
from tests.serving import run_serve

TOKEN = re.compile(r"tkv_[A-Za-z0-9_-]{43}")
REFUSAL = "no tenantkv cache at"


def non_caches(tmp_path: Path) -> list[Path]:
    """A mistyped root (its parent missing too) and an existing empty directory."""
    empty = tmp_path / "empty"
    empty.mkdir()
    return [tmp_path / "typo" / "cache", empty]


def assert_untouched(root: Path) -> None:
    if root.name == "empty":
        assert list(root.iterdir()) == [], "something was created in an empty directory"
    else:
        assert not root.parent.exists(), f"{root.parent} was created"


def one_sentence_refusal(err: str) -> None:
    assert REFUSAL in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "command",
    [
        ["token", "create", "{root}", "--role", "operator"],
        ["token", "list", "{root}"],
        ["token", "recover", "{root}", "--out", "{out}"],
        ["audit", "export", "{root}"],
        ["audit", "public-key", "{root}"],
        ["gc", "{root}"],
        ["info", "{root}"],
        ["db", "upgrade", "{root}"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_commands_refuse_a_root_without_a_cache_and_create_nothing(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    for root in non_caches(tmp_path):
        out = tmp_path / f"{root.name}.token"
        argv = [part.format(root=root, out=out) for part in command]
        assert main(argv) != 0
        streams = capsys.readouterr()
        one_sentence_refusal(streams.err)
        assert TOKEN.search(streams.out) is None
        assert_untouched(root)
        assert not out.exists()
    initialised = tmp_path / "initialised"  # positive control: an initialised root works
    assert main(["init", str(initialised)]) == 0
    capsys.readouterr()
    argv = [part.format(root=initialised, out=tmp_path / "ok.token") for part in command]
    assert main(argv) == 0, capsys.readouterr().err


def test_token_create_and_audit_export_work_on_an_initialised_root(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    assert main(["init", str(root)]) == 0
    capsys.readouterr()
    assert main(["token", "create", str(root), "--role", "auditor"]) == 0
    (token,) = TOKEN.findall(capsys.readouterr().out)
    with tenantkv.open(root, create=False) as kv:
        assert kv.tokens.authenticate(token).role == "auditor"
    assert main(["audit", "export", str(root)]) == 0
    actions = [json.loads(line).get("action") for line in capsys.readouterr().out.splitlines()]
    assert "token.create" in actions


def test_serve_refuses_a_root_without_a_cache(tmp_path: Path, index: Index) -> None:
    for root in non_caches(tmp_path):
        run = run_serve(root, index.url(root))
        assert not run.served and run.returncode != 0, run.output
        one_sentence_refusal(run.output)
        assert_untouched(root)


def test_serve_serves_an_initialised_root(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    assert main(["init", str(root)]) == 0
    capsys.readouterr()
    run = run_serve(root, index.url(root))
    assert run.served, run.output


def test_the_library_opens_without_creating_only_when_asked(tmp_path: Path, index: Index) -> None:
    for root in non_caches(tmp_path):
        with pytest.raises(CacheNotFoundError, match=REFUSAL):
            tenantkv.open(root, create=False)
        assert_untouched(root)
    root = tmp_path / "new"
    tenantkv.open(root).close()  # the default creates (embedders, the demos)
    with tenantkv.open(root, create=False) as kv:  # and then it holds a cache
        assert kv.list_tenants() == []


def test_a_failed_first_open_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unreachable = tmp_path / "a" / "cache"
    with pytest.raises(CacheUnavailableError):  # no index server there
        tenantkv.open(unreachable, database_url="postgresql+psycopg://postgres@127.0.0.1:1/x")
    assert not (tmp_path / "a").exists()
    no_dir = tmp_path / "b" / "cache"
    with pytest.raises(CacheUnavailableError):  # SQLite cannot create a file there
        tenantkv.open(no_dir, database_url=f"sqlite:///{tmp_path / 'missing' / 'index.db'}")
    assert not (tmp_path / "b").exists()  # no master.key, no blocks/, no root
    monkeypatch.setenv("TENANTKV_MASTER_KEY", "not a key")
    bad_key = tmp_path / "c" / "cache"
    with pytest.raises(MasterKeyError):
        tenantkv.open(bad_key, database_url=f"sqlite:///{tmp_path / 'c.db'}")
    assert not (tmp_path / "c").exists() and not (tmp_path / "c.db").exists()
    monkeypatch.delenv("TENANTKV_MASTER_KEY")
    with tenantkv.open(bad_key, database_url=f"sqlite:///{tmp_path / 'c.db'}") as kv:
        kv.create_tenant("acme")  # positive control: the same root and index, a good key
    assert (bad_key / "master.key").exists()
