"""The admin actions on the command line (issue 37): tenants, usage, purge, data keys, capacity,
jobs and tokens, each checked against the cache it changed; and bad input answered with one
sentence and a non-zero exit, the traceback only with ``--debug``."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

import tenantkv
from tenantkv import InvalidRequestError, TenantKV
from tenantkv.cli import main
from tenantkv.cli.output import size
from tests.helpers import MLA_SMALL, random_layers, random_tokens
from tests.indexes import Index


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def store(kv: TenantKV, tenant: str, seed: int, scope: str | None = None) -> list[int]:
    ns = kv.namespace(tenant, model="m", layout=MLA_SMALL, scope=scope)
    tokens = random_tokens(64, seed=seed)
    ns.store(tokens, random_layers(MLA_SMALL, 64, seed=seed))
    return tokens


@pytest.fixture(name="root")
def root_fixture(tmp_path: Path, index: Index, monkeypatch: pytest.MonkeyPatch) -> str:
    """A cache with tenants acme and globex; its index URL in the environment, so that a
    detached job's own process opens the same index on either backend."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TENANTKV_DATABASE_URL", index.url(root))
    with tenantkv.open(root, durable=False) as kv:
        kv.create_tenant("acme")
        kv.create_tenant("globex")
    return str(root)


def test_tenant_lifecycle(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    made = run_json(
        capsys, "tenant", "create", "initech", root, "--quota", "1GiB", "--retention", "chat=2d"
    )
    assert made["name"] == "initech" and made["quota_bytes"] == 2**30
    assert made["retention"]["chat"] == 2 * 86400
    listed = run_json(capsys, "tenant", "list", root)
    assert [t["name"] for t in listed] == ["acme", "globex", "initech"]
    code, out, _ = run(capsys, "tenant", "list", root)
    assert code == 0 and "initech" in out and "1.0 GiB" in out  # the table
    updated = run_json(capsys, "tenant", "update", "initech", root, "--quota", "512MiB")
    assert updated["quota_bytes"] == 2**29
    with tenantkv.open(root, create=False) as kv:
        assert kv.get_tenant("initech").quota_bytes == 2**29  # the change is in the index
    code, _, err = run(capsys, "tenant", "delete", "initech", root)
    assert code == 2 and "--yes" in err  # refused without confirmation ...
    assert run_json(capsys, "tenant", "show", "initech", root)["name"] == "initech"  # ... kept
    job = run_json(capsys, "tenant", "delete", "initech", root, "--yes")
    assert job["state"] == "succeeded" and job["kind"] == "tenant.delete"
    code, _, err = run(capsys, "tenant", "show", "initech", root)
    assert code == 2 and err == "tenantkv: no tenant named 'initech'\n"


def test_usage_of_every_tenant_in_one_table(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    with tenantkv.open(root, create=False) as kv:
        tokens = store(kv, "acme", seed=1)
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        ns.lookup(tokens + random_tokens(64, seed=2))  # 64 hit, 64 miss
        with ns.load(tokens) as stream:
            for _ in stream:
                pass
        expected = kv.usage("acme").counters
    rows = {r["tenant"]: r for r in run_json(capsys, "usage", root, "--since", "1h")}
    assert set(rows) == {"acme", "globex"}
    assert rows["acme"]["hit_tokens"] == expected["hit_tokens"] == 64
    assert rows["acme"]["miss_tokens"] == expected["miss_tokens"]
    assert rows["acme"]["served_tokens"] == 64
    assert rows["acme"]["served_bytes"] == 64 * MLA_SMALL.num_layers * MLA_SMALL.token_bytes
    assert rows["globex"]["served_bytes"] == 0
    looked_up = expected["hit_tokens"] + expected["miss_tokens"]
    assert rows["acme"]["hit_ratio"] == pytest.approx(64 / looked_up)
    assert rows["acme"]["cost_units"] == pytest.approx(expected["miss_tokens"] + 64 / 50)
    assert rows["globex"]["hit_tokens"] == 0 and rows["globex"]["hit_ratio"] is None
    before = run_json(capsys, "usage", root, "--since", "2020-01-01", "--until", "2020-01-02")
    assert all(r["hit_tokens"] == 0 for r in before)  # a window before the use holds none of it
    code, _, err = run(capsys, "usage", root, "--since", "2h", "--until", "3h")
    assert code == 2 and err == "tenantkv: since must be before until\n"
    code, out, _ = run(capsys, "usage", root, "--since", "7d")
    assert code == 0 and "acme" in out and f"{100 * 64 / looked_up:.1f}%" in out
    assert "served bytes" in out and size(rows["acme"]["served_bytes"]) in out
    code, _, err = run(capsys, "usage", root, "--since", "30s")
    assert code == 2 and "metering resolution of 60 seconds" in err
    code, _, err = run(capsys, "usage", root, "--since", "last week")
    assert code == 2 and err.count("\n") == 1 and "'last week' is not a point in time" in err


def test_purge_and_data_keys_run_as_jobs(
    root: str, capsys: pytest.CaptureFixture[str], index: Index
) -> None:
    with tenantkv.open(root, create=False) as kv:
        kept = store(kv, "acme", seed=1)
        theirs = store(kv, "globex", seed=1)
    assert run_json(capsys, "datakey", "rotate", "acme", root) == {
        "key_version": 2,
        "tenant": "acme",
    }
    retired = run_json(capsys, "datakey", "retire", "acme", root)
    assert retired["state"] == "succeeded" and retired["result"]["retired_versions"] == [1]
    assert retired["done"] == retired["total"] == 1
    with tenantkv.open(root, create=False) as kv:
        assert kv.get_tenant("acme").key_versions == (2,)
        assert kv.namespace("acme", model="m", layout=MLA_SMALL).lookup(kept) == 64
    code, out, err = run(capsys, "purge", "acme", root, "--detach")
    assert code == 0 and "job wait" in err
    job_id = out.strip()
    waited = run_json(capsys, "job", "wait", job_id, root)
    assert waited["state"] == "succeeded" and waited["result"]["extents"] == 1
    assert run_json(capsys, "job", "show", job_id, root)["kind"] == "purge"
    listed = run_json(capsys, "job", "list", root)
    assert [j["kind"] for j in listed][:2] == ["purge", "keys.retire"]
    with tenantkv.open(root, create=False) as kv:
        assert kv.namespace("acme", model="m", layout=MLA_SMALL).lookup(kept) == 0
        assert kv.namespace("globex", model="m", layout=MLA_SMALL).lookup(theirs) == 64
    code, _, err = run(capsys, "job", "resume", job_id, root)
    assert code == 2 and "only an interrupted or failed job resumes" in err
    code, _, err = run(capsys, "job", "show", "0123456789abcdef", root)
    assert code == 2 and err == "tenantkv: no job 0123456789abcdef\n"


def _orphan(indexed: Path, age: float) -> Path:
    """A copy of an extent file under a fresh id (so unindexed), last modified ``age`` ago."""
    new_id = secrets.token_hex(16)
    target = indexed.parent.with_name(new_id[:2]) / f"{new_id}.tkx"
    target.parent.mkdir(exist_ok=True)
    shutil.copyfile(indexed, target)
    then = time.time() - age
    os.utime(target, (then, then))
    return target


def test_gc_runs_as_a_job(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    with tenantkv.open(root, create=False) as kv:
        kept = store(kv, "acme", seed=1)
    (indexed,) = (Path(root) / "blocks" / "extents").glob("*/*.tkx")
    old, young = _orphan(indexed, age=3600), _orphan(indexed, age=0)
    done = run_json(capsys, "gc", root, "--orphan-grace", "600")
    assert done["kind"] == "gc" and done["state"] == "succeeded" and done["tenant"] is None
    assert done["result"]["orphans_removed"] == 1 and done["result"]["expired_extents"] == 0
    assert done["total"] is not None and done["done"] == done["total"]  # what the bar shows
    assert not old.exists() and young.exists()  # within the grace: maybe a store in flight
    code, out, err = run(capsys, "gc", root, "--detach", "--orphan-grace", "0")
    assert code == 0 and "job wait" in err
    waited = run_json(capsys, "job", "wait", out.strip(), root)
    assert waited["kind"] == "gc" and waited["state"] == "succeeded"
    assert waited["result"]["orphans_removed"] == 1 and not young.exists()
    assert indexed.exists()  # the indexed extent is kept, however old
    with tenantkv.open(root, create=False) as kv:
        assert kv.namespace("acme", model="m", layout=MLA_SMALL).lookup(kept) == 64
    code, out, _ = run(capsys, "gc", root)
    assert code == 0 and "0 orphaned files" in out and "(job " in out
    listed = run_json(capsys, "job", "list", root)
    assert [j["kind"] for j in listed] == ["gc", "gc", "gc"]
    code, _, err = run(capsys, "gc", root, "--orphan-grace", "-1")
    assert code == 2 and err.count("\n") == 1 and "orphan_grace must be from 0" in err
    assert len(run_json(capsys, "job", "list", root)) == 3  # refused before any job was made


def test_capacity_and_overcommit(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    shown = run_json(capsys, "capacity", "show", root)
    assert shown["tenants"] == 2 and shown["allow_overcommit"] is False
    changed = run_json(capsys, "capacity", "set", root, "--bytes", "4TiB", "--overcommit")
    assert changed["capacity_bytes"] == 4 * 2**40 and changed["allow_overcommit"] is True
    with tenantkv.open(root, create=False) as kv:
        assert kv.capacity_bytes == 4 * 2**40 and kv.allow_overcommit
    code, _, err = run(capsys, "capacity", "set", root, "--bytes", "lots")
    assert code == 2 and "'lots' is not a size" in err


def test_tokens_have_names_and_whoami_says_who(
    root: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = run(capsys, "token", "create", root, "--role", "auditor", "--name", "siem")
    assert code == 0
    token_file = tmp_path / "token"
    token_file.write_text(out)
    listed = run_json(capsys, "token", "list", root)
    assert [(t["name"], t["role"]) for t in listed] == [("siem", "auditor")]
    who = run_json(capsys, "whoami", root, "--token-file", str(token_file))
    assert who["name"] == "siem" and who["role"] == "auditor" and who["tenant"] is None
    assert who["token_id"] == listed[0]["id"]
    token_file.write_text("tkv_" + "x" * 43)
    code, _, err = run(capsys, "whoami", root, "--token-file", str(token_file))
    assert code == 2 and err == "tenantkv: the token is not valid (unknown)\n"
    code, _, err = run(capsys, "token", "create", root, "--role", "auditor", "--name", "no spaces")
    assert code == 2 and "a token name is" in err


@pytest.mark.parametrize(
    ("argv", "env", "sentence"),
    [
        (["tenant", "show", "nobody", "ROOT"], {}, "no tenant named 'nobody'"),
        (["purge", "nobody", "ROOT"], {}, "no tenant named 'nobody'"),
        (["datakey", "retire", "nobody", "ROOT"], {}, "no tenant named 'nobody'"),
        (["usage", "ROOT", "--since", "7x"], {}, "'7x' is not a point in time"),
        (["tenant", "create", "x", "ROOT", "--quota", "-1"], {}, "'-1' is not a size"),
        (["tenant", "list", str(Path("/nonexistent/cache"))], {}, "does not exist"),
        (
            ["tenant", "list", "ROOT"],
            {"TENANTKV_DATABASE_URL": "mysql://db/x"},
            "scheme mysql:// is not supported",
        ),
        (
            ["tenant", "list", "ROOT"],
            {"TENANTKV_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/x"},
            "127.0.0.1:1",
        ),
    ],
)
def test_bad_input_is_one_sentence_and_a_nonzero_exit(
    root: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    env: dict[str, str],
    sentence: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    where = [root if arg == "ROOT" else arg for arg in argv]
    code, _, err = run(capsys, *where)
    assert code != 0
    assert err.count("\n") == 1 and err.startswith("tenantkv: "), err
    assert sentence in err and "Traceback" not in err
    with pytest.raises(Exception):  # noqa: B017 -- whatever it was, --debug lets it through
        main(["--debug", *where])


def test_window_shorter_than_the_resolution_is_refused_by_the_python_api(root: str) -> None:
    with tenantkv.open(root, create=False) as kv:
        now = kv.now()
        with pytest.raises(InvalidRequestError, match="metering resolution of 60 seconds"):
            kv.usage("acme", since=now - 120, until=now - 90)
        with pytest.raises(InvalidRequestError, match="metering resolution"):
            kv.usage_of_all(since=now - 10)
        assert kv.usage("acme", since=now - 120, until=now).counters["hit_tokens"] == 0
