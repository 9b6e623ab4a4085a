"""``tenantkv audit export | public-key | verify`` round trips through real files.

The parser is built here the way ``tenantkv.cli`` will build it: an ``ArgumentParser`` whose
subcommands ``register`` extends. The cache is a real one (``tenantkv.open``: its index on each
backend, key file).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

import tenantkv
from tenantkv.audit import (
    AUDIT_EXPORT,
    KEYS_ROTATE,
    TENANT_CREATE,
    AuditEvent,
)
from tenantkv.cli import audit as cli_audit
from tenantkv.crypto import MASTER_KEY_ENV
from tests.indexes import Index

T0 = datetime(2025, 1, 1, tzinfo=UTC).timestamp()


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tenantkv")
    cli_audit.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.handler(args))


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, index: Index) -> Iterator[Path]:
    """A cache with audit records for two tenants, a day apart."""
    monkeypatch.delenv(MASTER_KEY_ENV, raising=False)
    path = tmp_path / "cache"
    with tenantkv.open(path, durable=False) as kv:
        kv.audit.record(
            *(
                AuditEvent(
                    actor=f"{tenant}-admin",
                    role="operator",
                    tenant=tenant,
                    action=TENANT_CREATE if day < 2 else KEYS_ROTATE,
                    target=tenant,
                    time=T0 + day * 86400,
                )
                for day, tenant in enumerate(["acme", "globex", "acme"])
            )
        )
    yield path


def test_export_public_key_verify_round_trip(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export = tmp_path / "acme.jsonl"
    assert run(["audit", "export", str(root), "--tenant", "acme", "--output", str(export)]) == 0
    assert run(["audit", "public-key", str(root)]) == 0
    pem = capsys.readouterr().out
    assert pem.startswith("-----BEGIN PUBLIC KEY-----")
    key = tmp_path / "audit.pem"
    key.write_text(pem)

    assert run(["audit", "verify", str(export), "--public-key", str(key)]) == 0
    out = capsys.readouterr().out
    # "acme" is a chain here, not a tenant: the export's own record is on the system chain
    assert out.startswith("OK: 2 records in 1 chains") and "tenant:acme seq 1..2" in out
    lines = export.read_text().splitlines()
    actions = [json.loads(line.rsplit(',"', 1)[0] + "}").get("action") for line in lines]
    assert actions[:2] == [TENANT_CREATE, KEYS_ROTATE]
    assert not any("globex" in line for line in lines)
    assert not list(tmp_path.glob(".acme.jsonl.*"))  # no temp file left behind

    # one changed character: exit 1, with the problem listed
    export.write_text(export.read_text().replace("acme-admin", "acme-admix", 1))
    assert run(["audit", "verify", str(export), "--public-key", str(key)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("INVALID") and "hash does not match the record (edited)" in out


def test_export_to_stdout_with_a_time_range_and_siem_formats(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    since = datetime.fromtimestamp(T0 + 86400, UTC).isoformat()
    assert run(["audit", "export", str(root), "--since", since, "--format", "cef"]) == 0
    cef = capsys.readouterr().out.splitlines()
    # day 0 (acme create) is before --since; the cache's own capacity record (made when it was
    # first opened) and the export's own record (now) are after it
    actions = [line.split("|")[4] for line in cef]
    assert actions == ["capacity.update", AUDIT_EXPORT, KEYS_ROTATE, TENANT_CREATE]
    assert "cs1=globex" in cef[3] and "cs3=system" in cef[0]

    until = str(T0 + 86400)  # epoch seconds work too; until is exclusive
    out = tmp_path / "early.ocsf"
    argv = ["audit", "export", str(root), "--until", until, "--format", "ocsf"]
    assert run([*argv, "--output", str(out)]) == 0
    events = [json.loads(line) for line in out.read_text().splitlines()]
    assert [e["metadata"]["tenant_uid"] for e in events] == ["acme"]
    assert events[0]["class_uid"] == 6003


def test_verify_reports_unreadable_inputs(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export = tmp_path / "all.jsonl"
    assert run(["audit", "export", str(root), "--output", str(export)]) == 0
    bogus_key = tmp_path / "bogus.pem"
    bogus_key.write_text("not a key")
    assert run(["audit", "verify", str(export), "--public-key", str(bogus_key)]) == 1
    assert "not an Ed25519 public key" in capsys.readouterr().out
    assert run(["audit", "verify", str(tmp_path / "missing"), "--public-key", str(bogus_key)]) == 2


def test_main_runs_the_audit_commands_on_its_own(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_audit.main(["audit", "export", str(root), "--tenant", "globex"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # globex's one record (the export's own record is on the system chain: globex is a chain
    # here, not a tenant), the checkpoint the export anchored, and the export line
    assert len(lines) == 3 and json.loads(lines[-1].rsplit(',"', 1)[0] + "}")["type"] == "export"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1735689600", 1735689600.0),
        ("1735689600.25", 1735689600.25),
        ("2025-01-01T00:00:00Z", 1735689600.0),
        ("2025-01-01T00:00:00", 1735689600.0),  # naive: UTC
        ("2025-01-01T02:00:00+02:00", 1735689600.0),
    ],
)
def test_times_parse_as_iso_8601_or_epoch_seconds(text: str, expected: float) -> None:
    assert cli_audit.parse_time(text) == expected


def test_bad_times_and_ranges_are_refused(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        cli_audit.parse_time("yesterday")
    with pytest.raises(SystemExit):
        run(["audit", "export", str(root), "--since", "yesterday"])
    capsys.readouterr()
    assert run(["audit", "export", str(root), "--since", "20", "--until", "10"]) == 2
    assert "--since must be before --until" in capsys.readouterr().err


def test_an_export_is_recorded_on_the_tenants_chain_or_for_no_tenant_on_the_system_chain(
    root: Path, tmp_path: Path
) -> None:
    """Exporting the chains of a name that is no tenant now (one deleted, or never created)
    must not start a chain for it: the export's own record goes to the system chain."""
    with tenantkv.open(root, durable=False) as kv:
        kv.create_tenant("initech")
    for name in ("initech", "acme"):
        out = tmp_path / f"{name}.jsonl"
        assert run(["audit", "export", str(root), "--tenant", name, "--output", str(out)]) == 0
    whole = tmp_path / "all.jsonl"
    assert run(["audit", "export", str(root), "--output", str(whole)]) == 0
    records = [json.loads(line) for line in whole.read_text().splitlines()]
    exports = {
        r["details"]["tenant"]: r["chain"]
        for r in records
        if r.get("action") == AUDIT_EXPORT and r["details"].get("tenant")
    }
    assert exports["initech"].startswith("tenant:initech@")  # positive control: a tenant's own
    assert exports["acme"] == "system"
    chains = {r["chain"] for r in records if "chain" in r}
    assert chains == {"system", "tenant:acme", "tenant:globex", exports["initech"]}


def _verifies(root: Path, export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``audit verify``'s report on ``export`` (which must verify) against the cache's key."""
    capsys.readouterr()
    assert run(["audit", "public-key", str(root)]) == 0
    key = tmp_path / "audit.pem"
    key.write_text(capsys.readouterr().out)
    assert run(["audit", "verify", str(export), "--public-key", str(key)]) == 0
    return capsys.readouterr().out


def test_an_export_into_a_fifo_writes_through_it_and_leaves_it_a_fifo(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--output`` naming something other than a regular file (a FIFO here; ``/dev/null`` or
    ``/dev/stdout`` alike) is written in place: renaming a finished temp file onto it would put
    a regular file where the device or pipe was (as root, ``/dev/null`` itself)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[str] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    assert run(["audit", "export", str(root), "--tenant", "acme", "--output", str(fifo)]) == 0
    reader.join(timeout=60)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert not list(tmp_path.glob(".pipe.*"))  # no temp file beside it
    export = tmp_path / "received.jsonl"
    export.write_text(received[0])
    assert "tenant:acme seq 1..2" in _verifies(root, export, tmp_path, capsys)


def test_an_export_through_a_symlink_replaces_the_file_it_names_and_keeps_the_link(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A regular file is still replaced atomically, through a link too: the link stays."""
    real = tmp_path / "exports" / "audit.jsonl"
    real.parent.mkdir()
    real.write_text("stale\n")
    link = tmp_path / "latest.jsonl"
    link.symlink_to(real)
    assert run(["audit", "export", str(root), "--tenant", "acme", "--output", str(link)]) == 0
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert "stale" not in real.read_text()
    assert "tenant:acme seq 1..2" in _verifies(root, real, tmp_path, capsys)


def test_an_export_onto_a_directory_is_an_error(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["audit", "export", str(root), "--output", str(tmp_path)]) == 2
    assert "directory" in capsys.readouterr().err
    assert tmp_path.is_dir()
