"""The audit log against a real index (SQLite and PostgreSQL) and a real master key: chains,
transactions, isolation between tenants' exports, SIEM formats, streaming, signing-key storage,
retention.

Every check that something is absent has a positive control showing the same check finds it when
it is there, so no test passes because it looked in the wrong place.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_public_key
from sqlalchemy import event, func, select, update

from tenantkv.audit import (
    ACCESS_REFUSED,
    AUDIT_PURGE,
    DENIED,
    GENESIS_HASH,
    KEYS_ROTATE,
    QUOTA_REFUSED,
    SIGNING_KEY_CONTEXT,
    TENANT_CREATE,
    TENANT_DELETE,
    TENANT_UPDATE,
    USAGE_SUMMARY,
    AuditBase,
    AuditChainError,
    AuditChainHead,
    AuditEvent,
    AuditLog,
    AuditRecordRow,
    AuditRequestError,
    AuditSigningKey,
    AuditSigningKeyError,
    chain_for,
    verify_export,
)
from tenantkv.crypto import KeyEncryptionKey, SealOpenError
from tenantkv.index.database import Database
from tests.helpers import ManualClock
from tests.indexes import Index


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
    return ManualClock(1_700_000_000.0)


@pytest.fixture
def log(kek: KeyEncryptionKey, clock: ManualClock) -> AuditLog:
    return AuditLog(kek, clock=clock)


def event_for(tenant: str | None, action: str = TENANT_UPDATE, **fields: Any) -> AuditEvent:
    values: dict[str, Any] = {"actor": "alice", "role": "operator", "target": tenant or "system"}
    values.update(fields)
    return AuditEvent(tenant=tenant, action=action, **values)


def append(db: Database, log: AuditLog, event: AuditEvent) -> Any:
    with db.write() as session:
        return log.append(session, event)


def chain_rows(db: Database, chain: str) -> list[AuditRecordRow]:
    with db.read() as session:
        return list(
            session.scalars(
                select(AuditRecordRow)
                .where(AuditRecordRow.chain == chain)
                .order_by(AuditRecordRow.seq)
            )
        )


def head_of(db: Database, chain: str) -> tuple[int, str] | None:
    with db.read() as session:
        row = session.get(AuditChainHead, chain)
        return None if row is None else (row.last_seq, row.last_hash)


def pem_of(db: Database, log: AuditLog) -> bytes:
    with db.write() as session:
        return log.public_key_pem(session)


# ---- the chain ---------------------------------------------------------------------------------


def test_records_chain_per_tenant_with_the_documented_hash(
    db: Database, log: AuditLog, clock: ManualClock
) -> None:
    records = []
    for i in range(3):
        clock.advance(1.5)
        records.append(append(db, log, event_for("acme", details={"step": i, "name": "é"})))
    other = append(db, log, event_for("globex"))
    system = append(db, log, event_for(None, USAGE_SUMMARY, role="system"))

    assert [r.seq for r in records] == [1, 2, 3]
    assert records[0].prev_hash == GENESIS_HASH
    assert [r.prev_hash for r in records[1:]] == [r.hash for r in records[:-1]]
    assert (other.chain, other.seq, other.prev_hash) == ("tenant:globex", 1, GENESIS_HASH)
    assert (system.chain, system.seq, system.tenant) == ("system", 1, None)
    assert records[2].time_us == round(clock.now * 1_000_000)
    assert head_of(db, "tenant:acme") == (3, records[2].hash)

    # Recompute the hash from the encoding as docs/audit.md states it, independently.
    row = chain_rows(db, "tenant:acme")[1]
    body = {
        "action": row.action,
        "actor": row.actor,
        "chain": row.chain,
        "details": json.loads(row.details),
        "outcome": row.outcome,
        "prev_hash": row.prev_hash,
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
    assert hashlib.sha256(encoded.encode("utf-8")).hexdigest() == row.hash == records[1].hash
    line = records[1].to_jsonl()
    assert line == encoded[:-1] + f',"hash":"{row.hash}"}}'


def test_details_read_back_as_they_were_hashed(db: Database, log: AuditLog) -> None:
    record = append(db, log, event_for("acme", details={"versions": (1, 2), "ok": True}))
    assert record.details == {"versions": [1, 2], "ok": True}
    with db.read() as session:
        line = next(line for line in log.export(session, tenant="acme"))
    assert line == record.to_jsonl()


@pytest.mark.parametrize(
    "fields",
    [
        {"outcome": "maybe"},
        {"action": "Tenant Create"},
        {"actor": ""},
        {"actor": "x" * 257},
        {"target": "nul\x00byte"},
        {"details": {"ratio": float("nan")}},
        {"details": {1: "non-string key"}},
        {"details": {"blob": b"bytes"}},
        {"details": {"s": "\ud800"}},
        {"time": -1.0},
        {"tenant": ""},
    ],
)
def test_malformed_events_are_refused_before_anything_is_written(
    db: Database, log: AuditLog, fields: dict[str, Any]
) -> None:
    values: dict[str, Any] = {
        "actor": "alice",
        "role": "operator",
        "tenant": "acme",
        "action": TENANT_CREATE,
    }
    values.update(fields)
    with pytest.raises(AuditRequestError):
        append(db, log, AuditEvent(**values))
    assert head_of(db, "tenant:acme") is None
    # positive control: the same event without the bad field is accepted
    assert append(db, log, event_for("acme")).seq == 1


# ---- transactions ------------------------------------------------------------------------------


class ActionFailed(Exception):
    pass


def test_a_failure_after_append_before_commit_leaves_no_record(db: Database, log: AuditLog) -> None:
    first = append(db, log, event_for("acme", TENANT_CREATE))
    before = head_of(db, "tenant:acme")
    with pytest.raises(ActionFailed), db.write() as session:
        doomed = log.append(session, event_for("acme", TENANT_DELETE))
        assert doomed.seq == 2  # it was written into the open transaction...
        raise ActionFailed("the action it records failed")
    assert [r.seq for r in chain_rows(db, "tenant:acme")] == [1]  # ...and rolled back with it
    assert head_of(db, "tenant:acme") == before == (1, first.hash)
    # positive control: the chain continues from the committed head, without a gap
    after = append(db, log, event_for("acme", TENANT_DELETE))
    assert (after.seq, after.prev_hash) == (2, first.hash)


def test_a_failed_first_append_leaves_no_chain_head(db: Database, log: AuditLog) -> None:
    with pytest.raises(ActionFailed), db.write() as session:
        log.append(session, event_for("acme", TENANT_CREATE))
        raise ActionFailed
    assert head_of(db, "tenant:acme") is None and chain_rows(db, "tenant:acme") == []
    assert append(db, log, event_for("acme")).prev_hash == GENESIS_HASH


def test_several_appends_in_one_transaction_chain_in_order(db: Database, log: AuditLog) -> None:
    with db.write() as session:
        a = log.append(session, event_for("acme", TENANT_CREATE))
        b = log.append(session, event_for("acme", KEYS_ROTATE))
    assert (b.seq, b.prev_hash) == (a.seq + 1, a.hash)


# ---- exports: isolation and SIEM formats -------------------------------------------------------


def _populate_two_tenants(db: Database, log: AuditLog, clock: ManualClock) -> None:
    for i in range(4):
        clock.advance(10)
        append(db, log, event_for("acme", actor="acme-admin", target=f"acme-key-{i}"))
        append(db, log, event_for("globex", actor="globex-admin", target=f"globex-key-{i}"))
    append(db, log, event_for(None, USAGE_SUMMARY, actor="tenantkv", role="system"))


@pytest.mark.parametrize("fmt", ["jsonl", "cef", "ocsf"])
def test_a_tenant_export_holds_nothing_of_another_tenant(
    db: Database, log: AuditLog, clock: ManualClock, fmt: Any
) -> None:
    _populate_two_tenants(db, log, clock)
    acme = list(log.export(db.read, tenant="acme", fmt=fmt))
    globex = list(log.export(db.read, tenant="globex", fmt=fmt))
    everything = list(log.export(db.read, tenant=None, fmt=fmt))
    assert not any("globex" in line for line in acme)
    assert sum("acme-admin" in line for line in acme) == 4
    # positive controls: the same search finds globex in its own and in the full export
    assert sum("globex-admin" in line for line in globex) == 4
    assert not any("acme" in line for line in globex)
    assert sum("globex-admin" in line for line in everything) == 4
    assert sum("acme-admin" in line for line in everything) == 4


def test_jsonl_exports_verify_per_tenant_and_system_wide(
    db: Database, log: AuditLog, clock: ManualClock
) -> None:
    _populate_two_tenants(db, log, clock)
    pem = pem_of(db, log)
    acme = verify_export(log.export(db.read, tenant="acme"), pem)
    assert acme.ok, acme.problems
    assert [c.chain for c in acme.chains] == ["tenant:acme"] and acme.tenant == "acme"
    full = verify_export(log.export(db.read, tenant=None), pem)
    assert full.ok, full.problems
    assert [c.chain for c in full.chains] == ["system", "tenant:acme", "tenant:globex"]
    assert full.records == 9
    nobody = list(log.export(db.read, tenant="nobody"))
    assert len(nobody) == 1 and verify_export(nobody, pem).ok  # a signed "nothing happened"


def test_time_ranges_select_a_contiguous_verifiable_run(
    db: Database, log: AuditLog, clock: ManualClock
) -> None:
    start = clock.now
    for _ in range(6):
        clock.advance(10)
        append(db, log, event_for("acme"))
    pem = pem_of(db, log)
    lines = list(log.export(db.read, tenant="acme", since=start + 20, until=start + 50))
    report = verify_export(lines, pem)
    assert report.ok, report.problems
    assert [(c.first_seq, c.last_seq, c.from_genesis) for c in report.chains] == [(2, 4, False)]
    with pytest.raises(AuditRequestError):
        log.export(db.read, tenant="acme", since=start + 50, until=start + 20)
    with pytest.raises(AuditRequestError):
        log.export(db.read, tenant="acme", fmt="xml")  # type: ignore[arg-type]


_CEF_SPLIT = re.compile(r" (?=[A-Za-z0-9]+=)")


def parse_cef(line: str) -> tuple[list[str], dict[str, str]]:
    """A small CEF reader, written from the spec rather than from our writer."""
    header: list[str] = []
    current = ""
    i = 0
    while len(header) < 7:
        char = line[i]
        if char == "\\" and line[i + 1] in "\\|":
            current += line[i + 1]
            i += 2
            continue
        if char == "|":
            header.append(current)
            current = ""
        else:
            current += char
        i += 1
    extension: dict[str, str] = {}
    for pair in _CEF_SPLIT.split(line[i:]):
        key, _, raw = pair.partition("=")
        value = re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r"}.get(m.group(1), m.group(1)), raw)
        extension[key] = value
    return header, extension


def test_cef_lines_parse_and_carry_the_tenant(
    db: Database, log: AuditLog, clock: ManualClock
) -> None:
    tricky = "ops|team=a\\b\nsecond line"
    append(db, log, event_for("acme", TENANT_CREATE, actor=tricky, request_id="req-1"))
    append(db, log, event_for("acme", QUOTA_REFUSED, outcome=DENIED, target="k=v|x"))
    append(db, log, event_for(None, USAGE_SUMMARY, role="system"))
    lines = list(log.export(db.read, tenant=None, fmt="cef"))
    assert len(lines) == 3 and all("\n" not in line for line in lines)
    parsed = [parse_cef(line) for line in lines]
    system, created, refused = parsed  # chain order: system, then tenant:acme
    header, ext = created
    assert header[:4] == ["CEF:0", "tenantkv", "tenantkv", header[3]]
    assert header[4] == TENANT_CREATE and header[6] == "3"
    assert ext["cs1Label"] == "tenant" and ext["cs1"] == "acme"
    assert ext["suser"] == tricky and ext["externalId"] == "req-1"
    assert ext["cs3"] == "tenant:acme" and ext["cn1"] == "1"
    assert refused[0][6] == "8" and refused[1]["cs2"] == "k=v|x"
    assert refused[1]["outcome"] == DENIED
    assert "cs1" not in system[1] and system[1]["cs3"] == "system"
    assert int(created[1]["rt"]) == int(clock.now * 1000)


def test_ocsf_lines_are_api_activity_with_tenant_uid(
    db: Database, log: AuditLog, clock: ManualClock
) -> None:
    append(db, log, event_for("acme", TENANT_CREATE, request_id="req-7"))
    append(db, log, event_for("acme", KEYS_ROTATE))
    append(db, log, event_for("acme", TENANT_DELETE))
    append(db, log, event_for("acme", ACCESS_REFUSED, outcome=DENIED))
    append(db, log, event_for(None, USAGE_SUMMARY, role="system"))
    events = [json.loads(line) for line in log.export(db.read, tenant=None, fmt="ocsf")]
    assert len(events) == 5
    for item in events:
        assert item["class_uid"] == 6003 and item["category_uid"] == 6
        assert item["type_uid"] == 600300 + item["activity_id"]
        assert item["time"] == int(clock.now * 1000)
    system, *acme = events
    assert "tenant_uid" not in system["metadata"]
    assert [e["metadata"]["tenant_uid"] for e in acme] == ["acme"] * 4
    assert [e["activity_id"] for e in acme] == [1, 3, 4, 99]
    assert acme[0]["api"] == {
        "operation": TENANT_CREATE,
        "service": {"name": "tenantkv"},
        "request": {"uid": "req-7"},
    }
    assert acme[3]["status_id"] == 2 and acme[3]["status_detail"] == DENIED
    assert acme[0]["status_id"] == 1 and acme[0]["metadata"]["uid"] == "tenant:acme:1"


# ---- streaming ---------------------------------------------------------------------------------


def test_exports_stream_page_by_page(db: Database, log: AuditLog) -> None:
    total, page = 1200, 100
    with db.write() as session:
        for i in range(total):
            log.append(session, event_for("acme", details={"i": i}))
        log.ensure_signing_key(session)
    statements: list[str] = []

    @event.listens_for(db.engine, "before_cursor_execute")
    def _record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    def record_pages() -> list[str]:
        return [s for s in statements if "FROM tkv_audit_records" in s and "LIMIT" in s]

    lines = log.export(db.read, tenant="acme", page_size=page)
    assert isinstance(lines, types.GeneratorType)
    assert statements == []  # nothing is read before the first line is asked for
    first = next(lines)
    assert json.loads(first.rsplit(',"hash"', 1)[0] + "}")["seq"] == 1
    assert len(record_pages()) == 1  # one page so far, not the whole chain
    rest = list(lines)
    assert len(record_pages()) == total // page
    report = verify_export([first, *rest], pem_of(db, log))
    assert report.ok, report.problems
    assert report.records == total
    # an export inside one caller-held session streams the same lines
    with db.read() as session:
        assert list(log.export(session, tenant="acme", page_size=7))[:-2] == [first, *rest][:-2]


# ---- checkpoints and the signing key -----------------------------------------------------------


def test_checkpoints_sign_the_head_and_ride_along_in_exports(
    db: Database, log: AuditLog, clock: ManualClock
) -> None:
    for _ in range(3):
        append(db, log, event_for("acme"))
    with db.write() as session:
        checkpoint = log.checkpoint(session, chain_for("acme"))
    head = head_of(db, "tenant:acme")
    assert head is not None
    assert (checkpoint.seq, checkpoint.head_hash, checkpoint.count) == (3, head[1], 3)
    public = load_pem_public_key(pem_of(db, log))
    assert isinstance(public, Ed25519PublicKey)
    public.verify(checkpoint.signature, checkpoint.signed_bytes())
    forged = checkpoint.body() | {"count": 2}
    with pytest.raises(InvalidSignature):
        public.verify(checkpoint.signature, json.dumps(forged, sort_keys=True).encode())
    clock.advance(5)
    append(db, log, event_for("acme"))
    lines = list(log.export(db.read, tenant="acme"))
    assert lines[3] == checkpoint.to_jsonl()  # right after record 3, before record 4
    assert verify_export(lines, pem_of(db, log)).ok
    with db.write() as session, pytest.raises(AuditChainError):
        log.checkpoint(session, chain_for("nobody"))


def test_a_rewritten_chain_is_refused_by_the_head_mac(db: Database, log: AuditLog) -> None:
    """Someone with write access to the database recomputes every hash after editing record 1
    and moves the head; without the master key the head's MAC cannot follow, so the export
    refuses before signing anything (and the stored checkpoint still names the old head)."""
    for _ in range(3):
        append(db, log, event_for("acme"))
    with db.write() as session:
        log.checkpoint(session, chain_for("acme"))
    pem = pem_of(db, log)
    assert verify_export(log.export(db.read, tenant="acme"), pem).ok  # positive control
    with db.write() as session:
        rows = list(
            session.scalars(select(AuditRecordRow).where(AuditRecordRow.chain == "tenant:acme"))
        )
        rows.sort(key=lambda r: r.seq)
        prev = GENESIS_HASH
        for row in rows:
            if row.seq == 1:
                row.actor = "mallory"
            body = {
                "action": row.action,
                "actor": row.actor,
                "chain": row.chain,
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
            text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            row.prev_hash, row.hash = prev, hashlib.sha256(text.encode()).hexdigest()
            prev = row.hash
        session.execute(
            update(AuditChainHead)
            .where(AuditChainHead.chain == "tenant:acme")
            .values(last_hash=prev)
        )
    with pytest.raises(AuditChainError, match="fails its MAC"):
        list(log.export(db.read, tenant="acme"))
    report = verify_export(log.export(db.read, tenant="acme"), pem)
    assert not report.ok


def test_signing_key_is_stored_wrapped_never_in_clear(
    db: Database, log: AuditLog, kek: KeyEncryptionKey, index: Index
) -> None:
    append(db, log, event_for("acme"))
    with db.write() as session:
        key_id = log.ensure_signing_key(session)
        log.checkpoint(session, chain_for("acme"))
    with db.read() as session:
        row = session.scalars(select(AuditSigningKey)).one()
        wrapped, public_raw = bytes(row.wrapped_private_key), bytes(row.public_key)
    assert row.key_id == key_id == hashlib.sha256(public_raw).digest()[:16].hex()
    private_raw = kek.unwrap(wrapped, SIGNING_KEY_CONTEXT)  # the master key opens it...
    derived = Ed25519PrivateKey.from_private_bytes(private_raw).public_key()
    assert derived.public_bytes(Encoding.Raw, PublicFormat.Raw) == public_raw
    with pytest.raises(SealOpenError):  # ...and no other key does
        KeyEncryptionKey(os.urandom(32)).unwrap(wrapped, SIGNING_KEY_CONTEXT)
    db.close()  # let SQLite fold the WAL back; scan every file it keeps either way
    stored = index.stored_bytes(db.url)
    assert private_raw not in stored and private_raw.hex().encode() not in stored
    assert public_raw in stored and wrapped in stored  # positive controls: the scan sees rows


def test_a_wrong_master_key_or_swapped_public_key_is_refused(
    db: Database, log: AuditLog, clock: ManualClock
) -> None:
    pem = pem_of(db, log)
    stranger = AuditLog(KeyEncryptionKey(os.urandom(32)), clock=clock)
    with db.write() as session, pytest.raises(AuditSigningKeyError):
        stranger.public_key_pem(session)
    other_public = Ed25519PrivateKey.generate().public_key()
    with db.write() as session:
        session.execute(
            update(AuditSigningKey).values(
                public_key=other_public.public_bytes(Encoding.Raw, PublicFormat.Raw)
            )
        )
    fresh = AuditLog(log._keys._wrapper, clock=clock)  # no cached key: reads the altered row
    with db.write() as session, pytest.raises(AuditSigningKeyError):
        fresh.public_key_pem(session)
    assert pem.startswith(b"-----BEGIN PUBLIC KEY-----")


# ---- retention ---------------------------------------------------------------------------------


def test_purge_cuts_only_expired_prefixes_and_exports_still_verify(
    db: Database, kek: KeyEncryptionKey, clock: ManualClock
) -> None:
    log = AuditLog(kek, clock=clock, retention_seconds=100)
    start = clock.now
    for i in range(5):
        append(db, log, event_for("acme", time=start + 10 * i))  # t = 0, 10, 20, 30, 40
    append(db, log, event_for("acme", time=start - 500))  # seq 6: an old time after new ones
    append(db, log, event_for("globex", time=start))
    with db.write() as session:
        log.checkpoint(session, chain_for("acme"))
    clock.now = start + 125  # cutoff = start + 25: acme seq 1..3 and globex seq 1 expire
    with db.write() as session:
        assert log.purge_expired(session) == 4
    assert [r.seq for r in chain_rows(db, "tenant:acme")] == [4, 5, 6]  # seq 6 kept: not a prefix
    assert chain_rows(db, "tenant:globex") == []
    pem = pem_of(db, log)
    report = verify_export(log.export(db.read, tenant=None), pem)
    assert report.ok, report.problems
    acme = next(c for c in report.chains if c.chain == "tenant:acme")
    assert (acme.first_seq, acme.from_genesis, acme.checkpoints) == (4, False, 2)
    purge = [r for r in chain_rows(db, "system") if r.action == AUDIT_PURGE]
    assert len(purge) == 1
    assert json.loads(purge[0].details)["kept_from_seq"] == {"tenant:acme": 4, "tenant:globex": 2}
    # the chain continues across the purge, and globex's next record links to its purged head
    assert append(db, log, event_for("globex")).seq == 2
    assert verify_export(log.export(db.read, tenant="globex"), pem).ok
    with db.write() as session:
        assert log.purge_expired(session) == 0  # nothing newly expired: no purge record either
    with db.read() as session:
        count = session.scalar(
            select(func.count()).where(
                AuditRecordRow.chain == "system", AuditRecordRow.action == AUDIT_PURGE
            )
        )
    assert count == 1


def test_retention_must_be_positive(kek: KeyEncryptionKey) -> None:
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(AuditRequestError):
            AuditLog(kek, retention_seconds=bad)
    assert AuditLog(kek).retention_seconds == 365 * 86400
