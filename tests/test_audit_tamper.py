"""Tampering with the audit tables through the database alone (issue 13, item 4).

The attacker here can read and write every table with plain SQL, but has neither the master key
nor the cache root (key file, anchor file). Each attack is done exactly as the issue describes;
on the code before MACs, anchors and purge statements every one of them produced an export that
verified. Each test first shows that the legitimate owner's export verifies (positive control).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
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
from tenantkv.crypto import KeyEncryptionKey
from tenantkv.index import migrate
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
def kek() -> KeyEncryptionKey:
    return KeyEncryptionKey(os.urandom(32))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def anchors(tmp_path: Path) -> Path:
    return tmp_path / "root" / "audit-anchors.jsonl"


@pytest.fixture
def log(kek: KeyEncryptionKey, clock: ManualClock) -> AuditLog:
    """A log without an anchor file: MACs and purge statements alone."""
    return AuditLog(kek, clock=clock, retention_seconds=100)


@pytest.fixture
def anchored(kek: KeyEncryptionKey, clock: ManualClock, anchors: Path) -> AuditLog:
    """A log with an anchor file, as the cache builds it."""
    anchors.parent.mkdir()
    return AuditLog(kek, clock=clock, retention_seconds=100, anchor_path=anchors)


def append(db: Database, log: AuditLog, count: int, *, start: float = T0, **details: Any) -> None:
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
                    details=details,
                    time=start + i,
                ),
            )


def sql(db: Database, statement: str, **params: Any) -> list[Any]:
    """Raw SQL, as an attacker with database access runs it."""
    with db.write() as session:
        result = session.execute(text(statement), params)
        return list(result) if result.returns_rows else []


def report(db: Database, log: AuditLog, **scope: Any) -> VerifyReport:
    with db.write() as session:
        pem = log.public_key_pem(session)
    return verify_export(log.export(db.read, tenant="acme", **scope), pem)


def hash_of(db: Database, seq: int) -> str:
    (row,) = sql(
        db, "SELECT hash FROM tkv_audit_records WHERE chain = :c AND seq = :s", c=ACME, s=seq
    )
    return str(row[0])


def rehash(db: Database, first: int, last: int, *, actor: str | None = None) -> str:
    """Rewrite records ``first..last`` (``actor`` on the first one), recomputing every hash the
    way the documented format says; returns the new hash of ``last``."""
    rows = sql(
        db,
        "SELECT seq, time_us, actor, role, tenant, action, target, outcome, request_id, details,"
        " prev_hash FROM tkv_audit_records WHERE chain = :c AND seq BETWEEN :a AND :b ORDER BY seq",
        c=ACME,
        a=first,
        b=last,
    )
    prev = rows[0].prev_hash
    for row in rows:
        body = {
            "action": row.action,
            "actor": actor if actor is not None and row.seq == first else row.actor,
            "chain": ACME,
            "details": json.loads(row.details),
            "outcome": row.outcome,
            "prev_hash": prev,
            "request_id": row.request_id,
            "role": row.role,
            "seq": row.seq,
            "target": row.target,
            "tenant": row.tenant,
            "time_us": row.time_us,
            "type": "record",
            "v": 1,
        }
        encoded = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        digest = hashlib.sha256(encoded.encode()).hexdigest()
        sql(
            db,
            "UPDATE tkv_audit_records SET actor = :actor, prev_hash = :p, hash = :h"
            " WHERE chain = :c AND seq = :s",
            actor=body["actor"],
            p=prev,
            h=digest,
            c=ACME,
            s=row.seq,
        )
        prev = digest
    return prev


# ---- 4a: delete the newest records and rewind the head -----------------------------------------


def test_4a_deleting_the_newest_records_and_rewinding_the_head_is_refused(
    db: Database, log: AuditLog
) -> None:
    append(db, log, 5)
    with db.write() as session:
        log.checkpoint(session, ACME)  # the signed checkpoint covering seq 5 stays in the database
    assert report(db, log).ok  # positive control
    sql(db, "DELETE FROM tkv_audit_records WHERE chain = :c AND seq > 3", c=ACME)
    sql(
        db,
        "UPDATE tkv_audit_heads SET last_seq = 3, last_hash = :h WHERE chain = :c",
        h=hash_of(db, 3),
        c=ACME,
    )
    with pytest.raises(AuditChainError, match="fails its MAC"):
        list(log.export(db.read, tenant="acme"))
    assert not report(db, log).ok
    with db.write() as session, pytest.raises(AuditChainError, match="fails its MAC"):
        log.checkpoint(session, ACME)  # nothing signs the rewound head either


def test_4a_a_head_replayed_with_its_old_mac_is_caught_by_the_anchor_file(
    db: Database, anchored: AuditLog, kek: KeyEncryptionKey, clock: ManualClock
) -> None:
    """The attacker copied the head row (MAC included) at seq 3 and puts it back later."""
    append(db, anchored, 3)
    (saved,) = sql(db, "SELECT last_seq, last_hash, mac, mac_from_seq FROM tkv_audit_heads")
    append(db, anchored, 2, start=T0 + 3)
    with db.write() as session:
        anchored.checkpoint(session, ACME)
    assert report(db, anchored).ok  # positive control; the export anchors seq 5 outside the db
    sql(db, "DELETE FROM tkv_audit_records WHERE chain = :c AND seq > 3", c=ACME)
    sql(
        db,
        "UPDATE tkv_audit_heads SET last_seq = :s, last_hash = :h, mac = :m, mac_from_seq = :f"
        " WHERE chain = :c",
        s=saved[0],
        h=saved[1],
        m=saved[2],
        f=saved[3],
        c=ACME,
    )
    with pytest.raises(AuditChainError, match="seq 5 was anchored"):
        list(anchored.export(db.read, tenant="acme"))
    with pytest.raises(AuditChainError, match="seq 5 was anchored"):
        anchored.anchor(db.read)
    # Without the anchor file, the stored checkpoint of seq 5 is no longer left out of the
    # export: it lands after record 3, and verification says records are missing.
    no_anchors = AuditLog(kek, clock=clock)
    result = report(db, no_anchors)
    assert not result.ok
    assert any("does not match the record before it" in p for p in result.problems)


# ---- 4b: rewrite a record, re-hash the rest, delete the checkpoints -----------------------------


def test_4b_rewriting_and_rehashing_a_chain_and_deleting_checkpoints_is_refused(
    db: Database, log: AuditLog
) -> None:
    append(db, log, 5)
    with db.write() as session:
        log.checkpoint(session, ACME)
    assert report(db, log).ok  # positive control
    new_head = rehash(db, 2, 5, actor="mallory")
    sql(db, "UPDATE tkv_audit_heads SET last_hash = :h WHERE chain = :c", h=new_head, c=ACME)
    sql(db, "DELETE FROM tkv_audit_checkpoints")
    with pytest.raises(AuditChainError, match="fails its MAC"):
        list(log.export(db.read, tenant="acme"))
    assert not report(db, log).ok


def test_4b_a_rewrite_that_stops_before_the_head_is_caught_by_the_record_mac(
    db: Database, log: AuditLog
) -> None:
    """Re-hashing only up to the end of a time-bounded export leaves the head alone; the
    rewritten records' MACs still fail."""
    append(db, log, 5)
    until = T0 + 3  # records 1..3
    assert report(db, log, until=until).ok  # positive control
    rehash(db, 2, 3, actor="mallory")
    # the window's last record is checked before anything is signed, record 2 as it is read
    with pytest.raises(AuditChainError, match=r"record [23] fails its MAC"):
        list(log.export(db.read, tenant="acme", until=until))


# ---- 4c: delete the oldest records without any audit.purge record ------------------------------


def test_4c_deleting_the_oldest_records_fails_verification(db: Database, log: AuditLog) -> None:
    append(db, log, 5)
    assert report(db, log).ok  # positive control
    sql(db, "DELETE FROM tkv_audit_records WHERE chain = :c AND seq <= 2", c=ACME)
    result = report(db, log)
    assert not result.ok
    assert any("without a signed purge statement" in p for p in result.problems)
    # a since bound that starts after them no longer hides them: the export must show that
    # the record before its first (seq 2) is older than since, and seq 2 is gone
    with pytest.raises(AuditChainError, match="record 2, the one before"):
        list(log.export(db.read, tenant="acme", since=T0 + 2))
    assert report(db, log, since=T0 + 3).ok  # positive control: record 3 is there to show it


def test_4c_deleting_more_after_a_genuine_purge_fails_verification(
    db: Database, log: AuditLog, clock: ManualClock
) -> None:
    append(db, log, 5)
    clock.now = T0 + 102  # retention 100 s: seq 1 and 2 (t0, t0+1) expire
    with db.write() as session:
        assert log.purge_expired(session) == 2
    result = report(db, log)
    assert result.ok, result.problems  # positive control: the genuine purge verifies
    (acme,) = [c for c in result.chains if c.chain == ACME]
    assert (acme.first_seq, acme.from_genesis, acme.purged) == (3, False, True)
    sql(db, "DELETE FROM tkv_audit_records WHERE chain = :c AND seq = 3", c=ACME)
    result = report(db, log)
    assert not result.ok  # the statement says seq 3: nothing explains a start at seq 4
    assert any("starts at seq 4 without a signed purge statement" in p for p in result.problems)


# ---- positive controls -------------------------------------------------------------------------


def test_genuine_exports_verify_before_and_after_a_purge_and_anchoring(
    db: Database, anchored: AuditLog, clock: ManualClock, anchors: Path
) -> None:
    append(db, anchored, 4)
    with db.write() as session:
        anchored.checkpoint(session, ACME)
    assert report(db, anchored).ok
    assert len(anchored.anchor(db.read)) == 0  # the export anchored the head already
    append(db, anchored, 2, start=T0 + 200)
    assert [c.seq for c in anchored.anchor(db.read)] == [6]
    clock.now = T0 + 250  # seq 1..4 expire, the anchored seq 4 among them
    with db.write() as session:
        assert anchored.purge_expired(session) == 4
    result = report(db, anchored)
    assert result.ok, result.problems
    assert report(db, anchored, since=T0 + 200).ok
    # acme's exports anchored acme only; the purge's audit.purge record moved the system chain
    assert [c.chain for c in anchored.anchor(db.read)] == ["system"]
    names = [json.loads(line)["chain"] for line in anchors.read_text().splitlines()]
    assert names == [ACME, ACME, "system"]  # acme at seq 4 and 6; the purge left its head be
    assert stat.S_IMODE(anchors.stat().st_mode) == 0o600


# ---- the anchor file ---------------------------------------------------------------------------


def test_an_edited_or_truncated_anchor_file_is_reported(
    db: Database, anchored: AuditLog, anchors: Path, kek: KeyEncryptionKey, clock: ManualClock
) -> None:
    append(db, anchored, 2)
    assert report(db, anchored).ok
    lines = anchors.read_bytes().splitlines(keepends=True)
    assert len(lines) == 1
    edited = lines[0].replace(b'"seq":2', b'"seq":9')
    anchors.write_bytes(edited)
    fresh = AuditLog(kek, clock=clock, anchor_path=anchors)
    with pytest.raises(AuditChainError, match="does not verify"):
        fresh.anchor(db.read)
    anchors.write_bytes(lines[0])
    assert fresh.anchor(db.read) == []  # positive control: the genuine line reads back
    anchors.write_bytes(b"")
    with pytest.raises(AuditChainError, match="shrank"):
        fresh.anchor(db.read)


# ---- an index written before MACs --------------------------------------------------------------


def upgrade_index(db: Database, log: AuditLog) -> None:
    """What ``tenantkv db upgrade`` runs: the index's migrations, sealing with ``log``. The
    cache's other tables are created first, as every real index has them; the index carries no
    revision (it predates migrations), so every revision runs."""
    for metadata in migrate.all_metadata():
        metadata.create_all(db.engine)
    migrate.upgrade(db, log)


def test_an_index_from_before_macs_is_sealed_by_its_upgrade(
    db: Database, log: AuditLog, kek: KeyEncryptionKey, clock: ManualClock
) -> None:
    """Old tables lack the MAC columns, old records were hashed with U+2028 raw, and an old
    retention purge left no statement. The upgrade adds the columns, MACs the heads as they are,
    signs a purge statement for where the chain starts, and the export verifies."""
    append(db, log, 3, note="line\u2028break")
    for table, column in (
        ("tkv_audit_records", "mac"),
        ("tkv_audit_heads", "mac"),
        ("tkv_audit_heads", "mac_from_seq"),
    ):
        sql(db, f"ALTER TABLE {table} DROP COLUMN {column}")
    legacy_head = rehash(db, 1, 3)  # the old encoding: U+2028 written raw, hashed raw
    sql(db, "UPDATE tkv_audit_heads SET last_hash = :h WHERE chain = :c", h=legacy_head, c=ACME)
    sql(db, "DELETE FROM tkv_audit_records WHERE chain = :c AND seq = 1", c=ACME)  # old purge
    upgraded = AuditLog(kek, clock=clock)  # the new version upgrades it
    upgrade_index(db, upgraded)
    result = report(db, upgraded)
    assert result.ok, result.problems
    (acme,) = result.chains
    assert (acme.first_seq, acme.purged, acme.records) == (2, True, 2)
    append(db, upgraded, 1, start=T0 + 10)  # the chain continues, now with MACs
    assert report(db, upgraded).ok
    migrate.upgrade(db, upgraded)  # upgrading again changes nothing
    sql(db, "UPDATE tkv_audit_heads SET mac = NULL")  # and cannot be used to launder a head
    migrate.upgrade(db, upgraded)
    with pytest.raises(AuditChainError, match="no MAC"):
        list(upgraded.export(db.read, tenant="acme"))


def test_dropping_the_mac_columns_does_not_get_the_heads_resealed(
    db: Database, anchored: AuditLog
) -> None:
    """The upgrade trusts the database only on a node that never anchored: a node that did
    ran with MACs, so columns missing now were dropped (and the revision rewound) to launder a
    change."""
    append(db, anchored, 3)
    assert report(db, anchored).ok  # positive control (and the export anchors seq 3)
    upgrade_index(db, anchored)  # columns present: nothing to seal
    assert report(db, anchored).ok
    new_head = rehash(db, 2, 3, actor="mallory")
    sql(db, "UPDATE tkv_audit_heads SET last_hash = :h WHERE chain = :c", h=new_head, c=ACME)
    for table in ("tkv_audit_records", "tkv_audit_heads"):
        sql(db, f"ALTER TABLE {table} DROP COLUMN mac")
    sql(db, "ALTER TABLE tkv_audit_heads DROP COLUMN mac_from_seq")
    sql(db, "DELETE FROM alembic_version")  # as if it predated migrations
    migrate.upgrade(db, anchored)  # adds the columns back, but seals nothing
    with pytest.raises(AuditChainError, match="no MAC"):
        list(anchored.export(db.read, tenant="acme"))
