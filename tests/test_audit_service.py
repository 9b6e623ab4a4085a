"""The audit service (``kv.audit``) through its public API, on a real cache: which chain a
tenant's name means, checkpoints that cover their own request, exports that verify and hold only
the chains asked for, and records written together or not at all."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tenantkv
from tenantkv import TenantKV
from tenantkv.audit import SYSTEM_CHAIN, Attribution, AuditEvent, verify_export
from tests.indexes import Index

CALLER = Attribution("token:caller", "operator", "req-1")


@pytest.fixture(name="kv")
def kv_fixture(tmp_path: Path, index: Index) -> Iterator[TenantKV]:
    with tenantkv.open(tmp_path / "cache", durable=False) as kv:
        kv.create_tenant("acme")
        kv.create_tenant("globex")
        yield kv


def records(lines: Iterator[str]) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, lines) if r.get("type") == "record"]


def test_a_tenants_chain_is_its_current_incarnations(kv: TenantKV) -> None:
    first = kv.audit.current_chain("acme")
    assert first is not None and first.startswith("tenant:acme@")
    assert kv.audit.current_chain("globex") != first
    kv.delete_tenant("acme")
    assert kv.audit.current_chain("acme") is None
    kv.create_tenant("acme")
    assert kv.audit.current_chain("acme") not in (None, first)


def test_a_checkpoint_covers_its_own_request(kv: TenantKV) -> None:
    chain = kv.audit.current_chain("acme")
    checkpoint = kv.audit.checkpoint("acme", CALLER)
    assert checkpoint is not None and checkpoint.chain == chain
    last = records(kv.audit.export(tenant="acme", chain=chain))[-1]
    assert (last["action"], last["actor"], last["request_id"], last["seq"]) == (
        "audit.checkpoint",
        "token:caller",
        "req-1",
        checkpoint.seq,
    )
    assert kv.audit.checkpoints(checkpoint.chain) == [checkpoint]
    system = kv.audit.checkpoint(None, CALLER)
    assert system is not None and system.chain == SYSTEM_CHAIN
    assert kv.audit.checkpoints(SYSTEM_CHAIN) == [system]


def test_no_checkpoint_and_no_chain_for_a_tenant_that_does_not_exist(kv: TenantKV) -> None:
    before = records(kv.audit.export(tenant=None))
    assert kv.audit.checkpoint("initech", CALLER) is None
    assert records(kv.audit.export(tenant=None)) == before
    assert kv.audit.current_chain("initech") is None


def test_an_export_verifies_and_holds_only_the_tenant_asked_for(kv: TenantKV) -> None:
    pem = kv.audit.public_key_pem()
    assert kv.audit.public_key_pem(create=True) == pem
    everything = records(kv.audit.export(tenant=None))
    assert {r["tenant"] for r in everything} >= {"acme", "globex"}  # positive control
    acme = list(kv.audit.export(tenant="acme"))
    assert {r["tenant"] for r in records(iter(acme))} == {"acme"}
    report = verify_export(acme, pem)
    assert report.ok, report.problems
    tampered = [
        line.replace('"acme"', '"globex"', 1) if '"record"' in line else line for line in acme
    ]
    assert not verify_export(tampered, pem).ok


def test_an_export_is_recorded_on_its_tenants_chain_or_the_system_one(kv: TenantKV) -> None:
    by = Attribution("cli:someone", "operator")
    kv.audit.record_export(by, tenant="acme", target="-", details={"format": "jsonl"})
    kv.audit.record_export(by, tenant="initech", target="out", details={"tenant": "initech"})
    exports = [r for r in records(kv.audit.export(tenant=None)) if r["action"] == "audit.export"]
    assert [(r["chain"], r["actor"], r["target"]) for r in exports] == [
        (SYSTEM_CHAIN, "cli:someone", "out"),  # no tenant initech: no chain started for it
        (kv.audit.current_chain("acme"), "cli:someone", "-"),
    ]
    assert kv.audit.current_chain("initech") is None


def test_records_are_written_together_or_not_at_all(
    kv: TenantKV, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = [CALLER.event(None, "test.one"), CALLER.event(None, "test.two")]
    kv.audit.record(*events)
    actions = [r["action"] for r in records(kv.audit.export(tenant=None, chain=SYSTEM_CHAIN))]
    assert actions[-2:] == ["test.one", "test.two"]  # positive control
    append = kv.context.audit.append
    calls: list[AuditEvent] = []

    def second_fails(session: Any, event: AuditEvent) -> Any:
        calls.append(event)
        if len(calls) == 2:
            raise RuntimeError("the second append fails")
        return append(session, event)

    monkeypatch.setattr(kv.context.audit, "append", second_fails)
    with pytest.raises(RuntimeError):
        kv.audit.record(CALLER.event(None, "test.three"), CALLER.event(None, "test.four"))
    monkeypatch.undo()
    after = [r["action"] for r in records(kv.audit.export(tenant=None, chain=SYSTEM_CHAIN))]
    assert after == actions  # test.three was rolled back with the failed one
