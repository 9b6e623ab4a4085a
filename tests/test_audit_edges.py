"""Exports that prove their edges (issue 32, items 1 to 3).

The attacker writes the index with plain SQL but has neither the master key nor the cache root,
so cannot forge a MAC or a signature. What is left is deleting rows: here a run of records at the
edge of a time-bounded export's window, the records appended since the last anchor (leaving the
head row, whose MAC still holds), or every record of a chain. On the code before edge proofs each
of these produced exports that verified. Each test first shows that the untampered exports verify
(positive control).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from tenantkv.audit import (
    TENANT_UPDATE,
    AuditBase,
    AuditChainError,
    AuditEvent,
    AuditLog,
    VerifyReport,
    chain_for,
    verify_export,
)
from tenantkv.audit.canonical import canonical_json, sealed_line, split_sealed_line
from tenantkv.audit.signing import SigningKeys
from tenantkv.cli import audit as cli_audit
from tenantkv.crypto import KeyEncryptionKey
from tenantkv.index.database import Database
from tests.helpers import ManualClock
from tests.indexes import Index

T0 = 1_700_000_000.0
ACME = chain_for("acme")


@pytest.fixture
def db(tmp_path: Path, index: Index) -> Iterator[Database]:
    database = Database(index.database_url(tmp_path / "a.db"))
    AuditBase.metadata.create_all(database.engine)
    try:
        yield database
    finally:
        database.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def kek() -> KeyEncryptionKey:
    return KeyEncryptionKey(os.urandom(32))


@pytest.fixture
def log(kek: KeyEncryptionKey, clock: ManualClock) -> AuditLog:
    """A log without an anchor file: MACs, purge statements and edge proofs alone."""
    return AuditLog(kek, clock=clock, retention_seconds=100)


@pytest.fixture
def anchored(kek: KeyEncryptionKey, clock: ManualClock, tmp_path: Path) -> AuditLog:
    """A log with an anchor file, as the cache builds it."""
    root = tmp_path / "root"
    root.mkdir()
    return AuditLog(kek, clock=clock, retention_seconds=100, anchor_path=root / "anchors.jsonl")


def append(db: Database, log: AuditLog, count: int, *, start: float = T0) -> None:
    """``count`` records of acme, one a second from ``start``."""
    with db.write() as session:
        for i in range(count):
            log.append(
                session,
                AuditEvent(
                    actor="alice",
                    role="operator",
                    tenant="acme",
                    action=TENANT_UPDATE,
                    target="acme",
                    time=start + i,
                ),
            )


def sql(db: Database, statement: str, **params: Any) -> None:
    """Raw SQL, as an attacker with database access runs it."""
    with db.write() as session:
        session.execute(text(statement), params)


def delete_records(db: Database, first: int, last: int) -> None:
    sql(
        db,
        "DELETE FROM tkv_audit_records WHERE chain = :c AND seq BETWEEN :a AND :b",
        c=ACME,
        a=first,
        b=last,
    )


def pem_of(db: Database, log: AuditLog) -> bytes:
    with db.write() as session:
        return log.public_key_pem(session)


def report(db: Database, log: AuditLog, tenant: str | None = "acme", **scope: Any) -> VerifyReport:
    return verify_export(log.export(db.read, tenant=tenant, **scope), pem_of(db, log))


def refusal(db: Database, log: AuditLog, tenant: str | None = "acme", **scope: Any) -> str:
    """The exporter's refusal of an export (the test fails if it does not refuse)."""
    with pytest.raises(AuditChainError) as caught:
        list(log.export(db.read, tenant=tenant, **scope))
    return str(caught.value)


# ---- positive controls -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scope",
    [
        {},
        {"tenant": None},
        {"since": T0 + 3},
        {"until": T0 + 6},
        {"since": T0 + 3, "until": T0 + 6},
        {"since": T0 - 50, "until": T0 + 50},
        {"since": T0 + 9},
    ],
)
def test_untampered_bounded_and_unbounded_exports_verify(
    db: Database, log: AuditLog, scope: dict[str, Any]
) -> None:
    append(db, log, 10)  # seq 1..10 at T0..T0+9
    result = report(db, log, **scope)
    assert result.ok, result.problems
    (acme,) = [c for c in result.chains if c.chain == ACME]
    since, until = scope.get("since"), scope.get("until")
    first = 1 if since is None else max(1, int(since - T0) + 1)
    last = 10 if until is None else min(10, int(until - T0))
    assert (acme.first_seq, acme.last_seq) == (first, last)
    assert acme.head_seq == 10  # the exporter signed where the chain's head was
    assert (acme.before_seq is not None) == (first > 1)  # the record before a since window
    assert (acme.after_seq is not None) == (last < 10)  # the record after an until window


# ---- item 1: deletions at the edge of a time window --------------------------------------------


def test_until_edge_deletion_is_detected(db: Database, log: AuditLog) -> None:
    """Records 5 and 6 end the window [.., T0+6): deleting them left [.., T0+6) (seq 1..4) and
    [T0+6, ..) (seq 7..10) both verifying; only the unbounded export showed the gap."""
    append(db, log, 10)
    assert report(db, log, until=T0 + 6).ok  # positive controls
    assert report(db, log, since=T0 + 6).ok
    delete_records(db, 5, 6)
    assert "record 5" in refusal(db, log, until=T0 + 6)  # the record after seq 4 is gone
    assert "record 6" in refusal(db, log, since=T0 + 6)  # the record before seq 7 is gone
    assert not report(db, log, until=T0 + 6).ok
    assert not report(db, log, since=T0 + 6).ok
    assert not report(db, log).ok


def test_since_edge_deletion_is_detected(db: Database, log: AuditLog) -> None:
    """Records 4 and 5 start the window [T0+3, ..)."""
    append(db, log, 10)
    assert report(db, log, since=T0 + 3).ok  # positive controls
    assert report(db, log, since=T0 + 3, until=T0 + 8).ok
    assert report(db, log, until=T0 + 3).ok
    delete_records(db, 4, 5)
    assert "record 5" in refusal(db, log, since=T0 + 3)
    assert "record 5" in refusal(db, log, since=T0 + 3, until=T0 + 8)
    assert "record 4" in refusal(db, log, until=T0 + 3)
    assert not report(db, log, since=T0 + 3).ok


def test_a_time_column_changed_alone_does_not_move_a_record_out_of_a_window(
    db: Database, log: AuditLog
) -> None:
    """A record's MAC covers its hash, not its ``time_us`` column: setting record 6's time past
    ``until`` would end the window at seq 5 with record 6 as a plausible record after it."""
    append(db, log, 10)
    assert report(db, log, until=T0 + 6).ok  # positive control: seq 1..6
    sql(
        db,
        "UPDATE tkv_audit_records SET time_us = :t WHERE chain = :c AND seq = 6",
        t=int((T0 + 100) * 1_000_000),
        c=ACME,
    )
    assert "record 6 does not hash" in refusal(db, log, until=T0 + 6)


def test_a_since_window_that_starts_where_retention_cut_the_chain_verifies(
    db: Database, log: AuditLog, clock: ManualClock
) -> None:
    """The record before the window is gone by retention: the signed purge statement, not an
    edge record, explains the start. Deleting the first kept record on top of it does not."""
    append(db, log, 6)
    clock.now = T0 + 102  # retention 100 s: seq 1 and 2 expire
    with db.write() as session:
        assert log.purge_expired(session) == 2
    result = report(db, log, since=T0)
    assert result.ok, result.problems  # positive control
    (acme,) = result.chains
    assert (acme.first_seq, acme.purged, acme.before_seq) == (3, True, None)
    assert report(db, log, since=T0 + 3).ok  # the edge record is seq 3, kept
    delete_records(db, 3, 3)
    assert "record 3" in refusal(db, log, since=T0)
    assert "record 3" in refusal(db, log, since=T0 + 3)


# ---- item 2: the tail cut off, the head row left alone -----------------------------------------


def test_tail_truncation_with_the_head_row_left_alone_is_refused(
    db: Database, anchored: AuditLog
) -> None:
    """The records appended since the last anchor are deleted; the head row (its MAC valid) is
    not touched, so neither the head's MAC nor the anchor (at seq 3) notices."""
    append(db, anchored, 3)
    assert report(db, anchored, tenant=None).ok  # positive control; anchors seq 3
    append(db, anchored, 3, start=T0 + 3)
    with db.read() as session:  # positive control; an export inside a session anchors nothing
        assert verify_export(anchored.export(session, tenant=None), pem_of(db, anchored)).ok
    delete_records(db, 4, 6)
    assert "head" in refusal(db, anchored, tenant=None)
    assert "head" in refusal(db, anchored, tenant="acme")
    assert not report(db, anchored, tenant=None).ok


def test_tail_truncation_behind_a_stored_checkpoint_is_refused(db: Database, log: AuditLog) -> None:
    """A stored checkpoint at seq 5 sits between the records left (1..3) and the head (6): it
    used to be left out, as one at or below the head."""
    append(db, log, 5)
    with db.write() as session:
        log.checkpoint(session, ACME)
    append(db, log, 1, start=T0 + 5)
    assert report(db, log, tenant=None).ok  # positive control
    delete_records(db, 4, 6)
    assert "head" in refusal(db, log, tenant=None)
    assert "head" in refusal(db, log, tenant="acme", since=T0 + 1)


def test_a_stored_checkpoint_past_the_exported_records_travels_with_the_export(
    db: Database, log: AuditLog
) -> None:
    """Records 4 and 5 deleted, the head's record 6 kept: the range still reaches the head, so
    the stored checkpoint at seq 5 is exported and verification reports it."""
    append(db, log, 5)
    with db.write() as session:
        log.checkpoint(session, ACME)
    append(db, log, 1, start=T0 + 5)
    assert report(db, log, tenant=None).ok  # positive control
    delete_records(db, 4, 5)
    result = report(db, log, tenant=None)
    assert not result.ok
    assert any("checkpoint of tenant:acme at seq 5" in p for p in result.problems)


def test_a_head_whose_chain_has_no_records_is_refused(
    db: Database, log: AuditLog, clock: ManualClock
) -> None:
    append(db, log, 3)
    assert report(db, log, tenant=None).ok  # positive control
    delete_records(db, 1, 3)
    assert "no records" in refusal(db, log, tenant=None)
    assert "no records" in refusal(db, log, tenant="acme")


def test_a_chain_purged_whole_by_retention_still_exports(
    db: Database, log: AuditLog, clock: ManualClock
) -> None:
    """Positive control for the refusal above: a signed purge statement says every record of
    the chain went by retention, so the chain simply has nothing to export."""
    append(db, log, 3)
    clock.now = T0 + 200
    with db.write() as session:
        assert log.purge_expired(session) == 3
    result = report(db, log, tenant=None)
    assert result.ok, result.problems
    assert [c.chain for c in result.chains] == ["system"]  # the purge's own record


# ---- item 3: what `audit verify` says about a since export -------------------------------------


def run_verify(export: Path, key: Path) -> int:
    parser = argparse.ArgumentParser(prog="tenantkv")
    cli_audit.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["audit", "verify", str(export), "--public-key", str(key)])
    return int(args.handler(args))


def test_verify_says_a_since_export_starts_at_its_bound_not_after_a_purge(
    db: Database, log: AuditLog, clock: ManualClock, tmp_path: Path, capsys: Any
) -> None:
    append(db, log, 6)
    key = tmp_path / "audit.pem"
    key.write_bytes(pem_of(db, log))
    export = tmp_path / "since.jsonl"
    export.write_text("\n".join(log.export(db.read, tenant="acme", since=T0 + 3)) + "\n")
    assert run_verify(export, key) == 0
    out = capsys.readouterr().out
    assert "purged" not in out
    assert (
        "tenant:acme seq 4..6 (starts at the since bound; the record before it (seq 3, at "
        "2023-11-14T22:13:22Z) is older than since)"
    ) in out
    # positive control: a chain that does start after purged records still says so
    clock.now = T0 + 102
    with db.write() as session:
        assert log.purge_expired(session) == 2
    export.write_text("\n".join(log.export(db.read, tenant="acme")) + "\n")
    assert run_verify(export, key) == 0
    assert "tenant:acme seq 3..6 (starts after records purged by retention)" in (
        capsys.readouterr().out
    )


# ---- the verifier checks the signed edges on its own -------------------------------------------


def resigned(db: Database, kek: KeyEncryptionKey, lines: list[str], edit: Any) -> list[str]:
    """``lines`` with every checkpoint and trailer body passed through ``edit`` and signed
    again with the log's key: what an exporter that signed wrong facts would write (only the
    master key's holder can)."""
    with db.write() as session:
        signer = SigningKeys(kek, time.time).signer(session)
    out = []
    for line in lines:
        sealed = split_sealed_line(line)
        assert sealed is not None
        body_text, seal_field, _seal = sealed
        body = json.loads(body_text)
        if seal_field == "signature" and body["type"] in ("checkpoint", "export"):
            edit(body)
            line = sealed_line(body, seal_field, signer.sign(canonical_json(body)).hex())
        out.append(line)
    return out


def test_the_verifier_checks_the_edges_an_export_signs(
    db: Database, log: AuditLog, kek: KeyEncryptionKey
) -> None:
    append(db, log, 10)
    pem = pem_of(db, log)
    lines = list(log.export(db.read, tenant="acme", since=T0 + 3, until=T0 + 6))  # seq 4..6
    assert verify_export(lines, pem).ok  # positive control
    assert verify_export(resigned(db, kek, lines, lambda body: None), pem).ok  # and re-signing

    def problems(edit: Any) -> list[str]:
        result = verify_export(resigned(db, kek, lines, edit), pem)
        assert not result.ok
        return result.problems

    def edge(name: str, key: str, value: Any) -> Any:
        def edit(body: dict[str, Any]) -> None:
            if body.get("head_seq") is not None:
                body[name][key] = value

        return edit

    assert any(
        "inside the export's until bound" in p for p in problems(edge("after", "time_us", 0))
    )
    assert any(
        "not older than the export's since bound" in p
        for p in problems(edge("before", "time_us", int((T0 + 3) * 1e6)))
    )
    assert any("does not link to its last record" in p for p in problems(edge("after", "seq", 8)))
    assert any(
        "not the one its first record links to" in p
        for p in problems(edge("before", "hash", "0" * 64))
    )

    def drop(name: str) -> Any:
        def edit(body: dict[str, Any]) -> None:
            if body.get("head_seq") is not None:
                body[name] = None

        return edit

    assert any("names no record after it" in p for p in problems(drop("after")))
    assert any("nothing shows that the record before it" in p for p in problems(drop("before")))


def test_an_export_from_before_edge_proofs_still_verifies(
    db: Database, log: AuditLog, kek: KeyEncryptionKey, tmp_path: Path, capsys: Any
) -> None:
    """Format 1 (no edges in the export's checkpoints) is still read, and said to be older;
    a format 1 checkpoint in a format 2 export is not accepted."""
    append(db, log, 10)
    pem = pem_of(db, log)
    lines = list(log.export(db.read, tenant="acme", until=T0 + 6))

    def to_format_1(body: dict[str, Any]) -> None:
        for key in ("after", "before", "head_seq"):
            body.pop(key, None)
        body["v"] = 1

    old = resigned(db, kek, lines, to_format_1)
    result = verify_export(old, pem)
    assert result.ok, result.problems
    assert result.version == 1 and result.chains[0].head_seq is None
    key = tmp_path / "audit.pem"
    key.write_bytes(pem)
    export = tmp_path / "old.jsonl"
    export.write_text("\n".join(old) + "\n")
    assert run_verify(export, key) == 0
    assert "format 1" in capsys.readouterr().out

    def trailer_only(body: dict[str, Any]) -> None:
        if body["type"] == "checkpoint":
            to_format_1(body)

    mixed = verify_export(resigned(db, kek, lines, trailer_only), pem)
    assert not mixed.ok
    assert any("not of the trailer's format" in p for p in mixed.problems)
