"""Every character ``str.splitlines()`` splits at stays inside its export line (issue 13, item 11).

The docs allow ``verify_export(text.splitlines(), ...)``. ``json.dumps`` escapes the line breaks
below U+0020 but wrote U+0085, U+2028 and U+2029 raw, so a genuine export holding one (say, a
purge scope naming a tenant with U+2028) fell apart into extra "lines" and failed verification.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenantkv.audit import (
    TENANT_UPDATE,
    AuditBase,
    AuditEvent,
    AuditLog,
    canonical_json,
    verify_export,
)
from tenantkv.crypto import KeyEncryptionKey
from tenantkv.index.database import Database
from tests.indexes import Index

# Every character str.splitlines() breaks at.
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
T0 = 1_700_000_000.0


@pytest.fixture
def db(tmp_path: Path, index: Index) -> Iterator[Database]:
    database = Database(index.database_url(tmp_path / "a.db"))
    AuditBase.metadata.create_all(database.engine)
    try:
        yield database
    finally:
        database.close()


@pytest.fixture
def log() -> AuditLog:
    return AuditLog(KeyEncryptionKey(os.urandom(32)), clock=lambda: T0)


def _event(tenant: str, time: float, **details: object) -> AuditEvent:
    return AuditEvent(
        actor="alice",
        role="operator",
        tenant=tenant,
        action=TENANT_UPDATE,
        target=tenant,
        details=details,
        time=time,
    )


def _as_text(lines: Iterator[str]) -> str:
    return "".join(line + "\n" for line in lines)


def test_the_list_of_line_breaks_is_what_splitlines_splits_at() -> None:
    assert {c for c in map(chr, range(0x110000)) if len(f"a{c}b".splitlines()) > 1} == set(
        LINE_BREAKS
    )


def test_a_purge_scope_with_u2028_survives_splitlines(db: Database) -> None:
    now = [T0]
    log = AuditLog(KeyEncryptionKey(os.urandom(32)), clock=lambda: now[0], retention_seconds=10)
    tenant = "line\u2028sep\u2029para\x85nel"
    with db.write() as session:
        log.append(session, _event(tenant, T0))
        log.append(session, _event(tenant, T0 + 20))
    now[0] = T0 + 25
    with db.write() as session:
        assert log.purge_expired(session) == 1  # the audit.purge scope names the tenant's chain
        pem = log.public_key_pem(session)
    lines = list(log.export(db.read, tenant=None))
    assert any("line\\u2028sep\\u2029para\\u0085nel" in line for line in lines)
    text = _as_text(iter(lines))
    assert text.splitlines() == lines  # one line each, however it is split
    report = verify_export(text.splitlines(), pem)
    assert report.ok, report.problems
    assert report.records == 2  # positive control: the tenant's record and the purge record
    details = [json.loads(line.rsplit(',"', 1)[0] + "}").get("details") for line in lines]
    assert {"kept_from_seq": {f"tenant:{tenant}": 2}}.items() <= (
        next(d for d in details if d and "kept_from_seq" in d).items()
    )


def test_ocsf_lines_escape_them_too(db: Database) -> None:
    log = AuditLog(KeyEncryptionKey(os.urandom(32)), clock=lambda: T0)
    with db.write() as session:
        log.append(session, _event("acme", T0, note=LINE_BREAKS))
    (line,) = log.export(db.read, tenant="acme", fmt="ocsf")
    assert line.splitlines() == [line]
    assert json.loads(line)["unmapped"]["details"]["note"] == LINE_BREAKS


def test_canonical_bytes_escape_only_what_json_leaves_raw() -> None:
    encoded = canonical_json({"s": LINE_BREAKS}).decode("utf-8")
    assert encoded.splitlines() == [encoded]
    assert json.loads(encoded) == {"s": LINE_BREAKS}
    # a backslash followed by "u2028" is text, not an escaped U+2028, and stays so
    assert json.loads(canonical_json({"s": "\\u2028"})) == {"s": "\\u2028"}


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    note=st.text(
        alphabet=st.one_of(
            st.sampled_from(LINE_BREAKS + '\\"u2028'),
            st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
        ),
        max_size=40,
    )
)
def test_any_details_string_survives_export_splitlines_verify(
    db: Database, log: AuditLog, note: str
) -> None:
    tenant = f"t{os.urandom(6).hex()}"  # a fresh chain per example in the shared database
    with db.write() as session:
        log.append(session, _event(tenant, T0, note=note, key={note: [note]}))
        pem = log.public_key_pem(session)
    lines = list(log.export(db.read, tenant=tenant))
    text = _as_text(iter(lines))
    assert text.splitlines() == lines
    report = verify_export(text.splitlines(), pem)
    assert report.ok, report.problems
    record = json.loads(lines[0].rsplit(',"', 1)[0] + "}")
    assert record["details"] == {"note": note, "key": {note: [note]}}
