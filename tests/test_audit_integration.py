"""The cache records its own actions and security events in the audit log, in the same
transactions, and the exports verify offline."""

from __future__ import annotations

import json
import secrets
import stat
import threading
from pathlib import Path

import pytest
from sqlalchemy import text

import tenantkv
from tenantkv import TenantKV
from tenantkv.audit import verify_export
from tenantkv.cli import main
from tenantkv.crypto import KeyEncryptionKey
from tests.helpers import MLA_SMALL, random_layers, random_tokens


def _actions(kv: TenantKV, tenant: str | None) -> list[str]:
    lines = list(kv.context.audit.export(kv.context.index.read, tenant=tenant))
    with kv.context.index.read() as session:
        pem = kv.context.audit.public_key_pem(session)
    report = verify_export(lines, pem)
    assert report.ok, report.problems
    records = [json.loads(line.rsplit(',"', 1)[0] + "}") for line in lines]
    return [r["action"] for r in records if r.get("type") not in ("checkpoint", "export")]


def test_tenant_lifecycle_is_audited_and_verifies(kv: TenantKV) -> None:
    kv.create_tenant("acme", quota_bytes=2**26)
    kv.update_tenant("acme", quota_bytes=2**27)
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    ns.store(random_tokens(128), random_layers(MLA_SMALL, 128))
    kv.rotate_keys("acme")
    kv.retire_keys("acme")
    actions = _actions(kv, "acme")
    assert actions == ["tenant.create", "tenant.update", "keys.rotate", "keys.retire"]
    kv.delete_tenant("acme")
    assert "tenant.delete" in _actions(kv, "acme")


@pytest.mark.usefixtures("index")
def test_a_refused_action_leaves_no_record(tmp_path: Path) -> None:
    with tenantkv.open(tmp_path / "c", durable=False, capacity_bytes=2**20) as kv:
        with pytest.raises(tenantkv.QuotaExceededError):
            kv.create_tenant("big", quota_bytes=2**21)  # more than the capacity: rolled back
        with pytest.raises(tenantkv.InvalidRequestError):
            kv.create_tenant("bad", quota_bytes=0)
        kv.create_tenant("ok", quota_bytes=2**19)  # positive control
    with tenantkv.open(tmp_path / "c", durable=False) as kv:
        for name in ("big", "bad"):
            assert _actions(kv, name) == []  # the refused creates left no record
        assert _actions(kv, "ok") == ["tenant.create"]


def test_security_events_are_audited(kv: TenantKV, cache_root: Path) -> None:
    kv.create_tenant("acme", quota_bytes=2**16)
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    with pytest.raises(tenantkv.QuotaExceededError):
        ns.store(random_tokens(64 * 40), random_layers(MLA_SMALL, 64 * 40))  # larger than quota
    tokens = random_tokens(64)
    ns.store(tokens, random_layers(MLA_SMALL, 64))
    (extent,) = (cache_root / "blocks" / "extents").rglob("*.tkx")
    data = bytearray(extent.read_bytes())
    data[100] ^= 1
    extent.write_bytes(bytes(data))
    with pytest.raises(tenantkv.SegmentIntegrityError), ns.load(tokens) as stream:
        for _ in stream:
            pass
    actions = _actions(kv, "acme")
    assert "quota.refused" in actions and "segment.open_failed" in actions


@pytest.mark.usefixtures("index")
def test_gc_writes_usage_summaries_and_checkpoints(tmp_path: Path) -> None:
    now = [1_800_000_000.0]
    with tenantkv.open(tmp_path / "c", durable=False, clock=lambda: now[0]) as kv:
        kv.create_tenant("acme")
        kv.create_tenant("idle")
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        tokens = random_tokens(128)
        ns.store(tokens, random_layers(MLA_SMALL, 128))
        ns.lookup(tokens)
        now[0] += 120
        kv.gc(orphan_grace=10**9)
        summaries = [
            json.loads(line.rsplit(',"', 1)[0] + "}")
            for line in kv.context.audit.export(kv.context.index.read, tenant="acme")
        ]
        usage = [r for r in summaries if r.get("action") == "usage.summary"]
        assert len(usage) == 1
        assert usage[0]["details"]["hit_tokens"] == 128
        assert usage[0]["details"]["stored_tokens"] == 128
        assert "usage.summary" not in _actions(kv, "idle")  # nothing happened to it
        kv.gc(orphan_grace=10**9)  # no new complete minute: no second summary
        assert _actions(kv, "acme").count("usage.summary") == 1


@pytest.mark.usefixtures("index")
def test_cli_audit_commands_are_wired(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "c"
    with tenantkv.open(root, durable=False) as kv:
        kv.create_tenant("acme")
    export, key = tmp_path / "acme.jsonl", tmp_path / "audit.pem"
    assert main(["audit", "export", str(root), "--tenant", "acme", "--output", str(export)]) == 0
    assert main(["audit", "public-key", str(root)]) == 0
    key.write_text(capsys.readouterr().out)
    assert main(["audit", "verify", str(export), "--public-key", str(key)]) == 0
    export.write_text(export.read_text().replace("tenant.create", "tenant.delete", 1))
    assert main(["audit", "verify", str(export), "--public-key", str(key)]) == 1


@pytest.mark.usefixtures("index")
def test_nodes_collecting_at_once_write_one_usage_summary(tmp_path: Path) -> None:
    """Several nodes on one index run GC at the same moment: the minutes since the last summary
    are summarised once, not once per node, and the chains still verify."""
    now = [1_800_000_000.0]
    key = KeyEncryptionKey(secrets.token_bytes(32))
    nodes = [
        tenantkv.open(tmp_path / "c", durable=False, clock=lambda: now[0], master_key=key)
        for _ in range(4)
    ]
    try:
        nodes[0].create_tenant("acme")
        ns = nodes[0].namespace("acme", model="m", layout=MLA_SMALL)
        tokens = random_tokens(128)
        ns.store(tokens, random_layers(MLA_SMALL, 128))
        nodes[0].context.meter.flush(nodes[0].context.index)
        now[0] += 120
        barrier = threading.Barrier(len(nodes))
        errors: list[BaseException] = []

        def collect(node: TenantKV) -> None:
            try:
                barrier.wait()
                node.gc(orphan_grace=10**9)
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=collect, args=(node,)) for node in nodes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert _actions(nodes[0], "acme").count("usage.summary") == 1
        _actions(nodes[0], None)  # the system chain verifies too
    finally:
        for node in nodes:
            node.close()


@pytest.mark.usefixtures("index")
def test_the_cache_anchors_its_audit_log_and_the_cli_refuses_a_rewound_chain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the real cache: GC and exports append to ``<root>/audit-anchors.jsonl`` (0600),
    and ``tenantkv audit export`` refuses (exit 2) once the database alone rewound a chain."""
    root = tmp_path / "c"
    with tenantkv.open(root, durable=False) as kv:
        kv.create_tenant("acme")
        kv.update_tenant("acme", quota_bytes=2**27)
        kv.gc(orphan_grace=10**9)
        assert _actions(kv, "acme") == ["tenant.create", "tenant.update"]  # positive control
        with kv.context.index.read() as session:
            first_hash = session.execute(
                text(
                    "SELECT hash FROM tkv_audit_records WHERE chain LIKE 'tenant:acme%' AND seq = 1"
                )
            ).scalar_one()
    anchors = root / "audit-anchors.jsonl"
    assert stat.S_IMODE(anchors.stat().st_mode) == 0o600
    assert any(
        json.loads(line)["chain"].startswith("tenant:acme")
        for line in anchors.read_text().splitlines()
    )
    export = tmp_path / "acme.jsonl"
    assert main(["audit", "export", str(root), "--tenant", "acme", "--output", str(export)]) == 0
    with tenantkv.open(root, durable=False) as kv, kv.context.index.write() as session:
        session.execute(
            text("DELETE FROM tkv_audit_records WHERE chain LIKE 'tenant:acme%' AND seq > 1")
        )
        session.execute(
            text(
                "UPDATE tkv_audit_heads SET last_seq = 1, last_hash = :h"
                " WHERE chain LIKE 'tenant:acme%'"
            ),
            {"h": first_hash},
        )
    capsys.readouterr()
    assert main(["audit", "export", str(root), "--tenant", "acme", "--output", str(export)]) == 2
    assert "fails its MAC" in capsys.readouterr().err


@pytest.mark.usefixtures("index")
def test_the_anchor_file_can_be_moved_out_of_the_root(tmp_path: Path) -> None:
    elsewhere = tmp_path / "anchors" / "kv.jsonl"
    elsewhere.parent.mkdir()
    config = tenantkv.CacheConfig.from_env(
        {"TENANTKV_ROOT": str(tmp_path / "c"), "TENANTKV_AUDIT_ANCHOR_PATH": str(elsewhere)}
    )
    assert config.anchor_file == elsewhere
    assert tenantkv.CacheConfig(root=tmp_path / "c").anchor_file == tmp_path / "c" / (
        "audit-anchors.jsonl"
    )
    with tenantkv.open(config, durable=False) as kv:
        kv.create_tenant("acme")
        assert _actions(kv, "acme") == ["tenant.create"]  # the export anchors acme's chain
    assert elsewhere.read_text().count("\n") == 1
    assert not (tmp_path / "c" / "audit-anchors.jsonl").exists()
