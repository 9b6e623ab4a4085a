"""Offline verification: any edit, deletion, insertion, reordering or truncation of a JSONL
export is reported, and the untouched export verifies (the positive control every property
below depends on).

The export under attack is built once from a real SQLite log and has every kind of line: three
chains, one of them cut by a purge (so it starts from an anchor, not genesis), stored checkpoints
(two at the same seq), the export's own checkpoints and the signed trailer. Mutations work on the
file's bytes and verification reads it back the way ``audit verify`` does, line by line.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tenantkv.audit import (
    TENANT_UPDATE,
    USAGE_SUMMARY,
    AuditBase,
    AuditEvent,
    AuditLog,
    VerifyReport,
    chain_for,
    verify_export,
)
from tenantkv.crypto import KeyEncryptionKey
from tenantkv.index.database import Database

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Export:
    lines: list[bytes]  # without newlines
    public_key_pem: bytes
    other_key_pem: bytes

    @property
    def data(self) -> bytes:
        return b"".join(line + b"\n" for line in self.lines)


def verify_bytes(data: bytes, pem: bytes) -> VerifyReport:
    return verify_export(io.BytesIO(data), pem)


def _event(tenant: str | None, time: float, actor: str = "alice") -> AuditEvent:
    return AuditEvent(
        actor=actor,
        role="operator" if tenant else "system",
        tenant=tenant,
        action=TENANT_UPDATE if tenant else USAGE_SUMMARY,
        target=tenant or "usage",
        details={"at": time, "note": "naïve ✓"},
        time=time,
    )


def build_export(directory: Path) -> Export:
    db = Database(f"sqlite:///{directory}/a.db")
    AuditBase.metadata.create_all(db.engine)
    now = [1_700_000_000.0]
    log = AuditLog(KeyEncryptionKey(os.urandom(32)), clock=lambda: now[0], retention_seconds=50)
    try:
        start = now[0]
        with db.write() as session:
            for i in range(3):  # globex seq 1..3 at t-100: purged below
                log.append(session, _event("globex", start - 100 + i))
            for i in range(6):
                log.append(session, _event("acme", start + i, actor=f"admin-{i}"))
                if i == 2:
                    log.checkpoint(session, chain_for("acme"))
                    now[0] += 1
                    log.checkpoint(session, chain_for("acme"))  # two at one seq
            for i in range(3):
                log.append(session, _event("globex", start + 10 + i))
            log.append(session, _event(None, start + 20))
            log.checkpoint(session, chain_for("acme"))
        now[0] = start + 40  # cutoff start - 10: globex seq 1..3 go
        with db.write() as session:
            assert log.purge_expired(session) == 3
            pem = log.public_key_pem(session)
        lines = [line.encode() for line in log.export(db.read, tenant=None)]
    finally:
        db.close()
    other = AuditLog(KeyEncryptionKey(os.urandom(32)))
    other_db = Database(f"sqlite:///{directory}/b.db")
    AuditBase.metadata.create_all(other_db.engine)
    try:
        with other_db.write() as session:
            other_pem = other.public_key_pem(session)
    finally:
        other_db.close()
    return Export(lines, pem, other_pem)


@pytest.fixture(scope="module")
def export() -> Iterator[Export]:
    with tempfile.TemporaryDirectory() as directory:
        yield build_export(Path(directory))


def kinds(export: Export) -> list[str]:
    return [json.loads(line.rsplit(b',"', 1)[0] + b"}")["type"] for line in export.lines]


# ---- positive controls -------------------------------------------------------------------------


def test_the_untouched_export_verifies(export: Export) -> None:
    report = verify_bytes(export.data, export.public_key_pem)
    assert report.ok, report.problems
    assert [c.chain for c in report.chains] == ["system", "tenant:acme", "tenant:globex"]
    globex = report.chains[2]
    assert (globex.first_seq, globex.last_seq, globex.from_genesis) == (4, 6, False)
    acme = report.chains[1]
    assert (acme.records, acme.checkpoints, acme.from_genesis) == (6, 4, True)
    assert report.records == 6 + 3 + 2  # system: usage summary + the purge record
    # the fixture really has every kind of line the properties below attack
    assert kinds(export).count("checkpoint") == 3 + 3 and kinds(export)[-1] == "export"
    # the generator's own lines (str, no newlines) verify too
    assert verify_export([line.decode() for line in export.lines], export.public_key_pem).ok


def test_another_key_does_not_verify_it(export: Export) -> None:
    report = verify_bytes(export.data, export.other_key_pem)
    assert not report.ok
    assert any("not the given key" in p for p in report.problems)


# ---- tampering properties ----------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_any_byte_edit_is_detected(export: Export, data: st.DataObject) -> None:
    original = export.data
    position = data.draw(st.integers(0, len(original) - 1), label="position")
    replacement = data.draw(
        st.integers(0, 255).filter(lambda b: b != original[position]), label="byte"
    )
    edited = original[:position] + bytes([replacement]) + original[position + 1 :]
    assert not verify_bytes(edited, export.public_key_pem).ok


@FUZZ
@given(data=st.data())
def test_any_character_edit_is_detected(export: Export, data: st.DataObject) -> None:
    """Edits that keep the file valid UTF-8 and JSON-looking (the subtle kind)."""
    lines = [line.decode() for line in export.lines]
    index = data.draw(st.integers(0, len(lines) - 1), label="line")
    line = lines[index]
    position = data.draw(st.integers(0, len(line) - 1), label="position")
    char = data.draw(
        st.sampled_from('0123456789abcdef"{}:,. ef-_acmeglobxsystmAZ\\é').filter(
            lambda c: c != line[position]
        ),
        label="char",
    )
    lines[index] = line[:position] + char + line[position + 1 :]
    assert not verify_export(lines, export.public_key_pem).ok


@FUZZ
@given(data=st.data())
def test_deleting_any_lines_is_detected(export: Export, data: st.DataObject) -> None:
    count = len(export.lines)
    doomed = data.draw(
        st.sets(st.integers(0, count - 1), min_size=1, max_size=count), label="deleted"
    )
    kept = [line for i, line in enumerate(export.lines) if i not in doomed]
    assert not verify_export(kept, export.public_key_pem).ok


def forged_record(export: Export, template_index: int, actor: str) -> bytes:
    """A record line with a correct hash (an attacker can compute SHA-256 too)."""
    line = export.lines[template_index]
    body = json.loads(line.rsplit(b',"hash"', 1)[0] + b"}")
    body["actor"] = actor
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.sha256(text.encode()).hexdigest()
    return (text[:-1] + f',"hash":"{digest}"}}').encode()


@FUZZ
@given(data=st.data())
def test_inserting_any_line_is_detected(export: Export, data: st.DataObject) -> None:
    count = len(export.lines)
    records = [i for i, kind in enumerate(kinds(export)) if kind == "record"]
    inserted = data.draw(
        st.one_of(
            st.sampled_from(export.lines),  # a duplicate of a genuine line
            st.builds(
                lambda i, actor: forged_record(export, i, actor),
                st.sampled_from(records),
                st.text(min_size=1, max_size=8),
            ),
            st.binary(max_size=40).filter(lambda b: b"\n" not in b),
            st.just(b""),
        ),
        label="line",
    )
    where = data.draw(st.integers(0, count), label="at")
    lines = [*export.lines[:where], inserted, *export.lines[where:]]
    assert not verify_export(lines, export.public_key_pem).ok


@FUZZ
@given(data=st.data())
def test_reordering_lines_is_detected(export: Export, data: st.DataObject) -> None:
    order = data.draw(st.permutations(range(len(export.lines))), label="order")
    assume(order != list(range(len(export.lines))))
    lines = [export.lines[i] for i in order]
    assert not verify_export(lines, export.public_key_pem).ok


@FUZZ
@given(data=st.data())
def test_swapping_two_lines_is_detected(export: Export, data: st.DataObject) -> None:
    count = len(export.lines)
    a = data.draw(st.integers(0, count - 2), label="a")
    b = data.draw(st.integers(a + 1, count - 1), label="b")
    lines = list(export.lines)
    lines[a], lines[b] = lines[b], lines[a]
    assert not verify_export(lines, export.public_key_pem).ok


@FUZZ
@given(data=st.data())
def test_truncation_anywhere_is_detected(export: Export, data: st.DataObject) -> None:
    original = export.data
    # keep fewer bytes than the content (dropping only the final newline changes nothing)
    keep = data.draw(st.integers(0, len(original) - 2), label="keep")
    assert not verify_bytes(original[:keep], export.public_key_pem).ok


def test_dropping_a_whole_chain_is_detected(export: Export) -> None:
    kinds_ = kinds(export)
    kept = [
        line
        for line, kind in zip(export.lines, kinds_, strict=True)
        if kind == "export" or b'"chain":"tenant:globex"' not in line
    ]
    # its purge statement, 3 records and checkpoint went
    assert len(kept) == len(export.lines) - 5
    report = verify_export(kept, export.public_key_pem)
    assert not report.ok
    assert any("chains dropped" in p for p in report.problems)


def test_a_forged_record_at_a_chain_head_is_caught_by_the_checkpoint(export: Export) -> None:
    kinds_ = kinds(export)
    last_acme = max(
        i
        for i, line in enumerate(export.lines)
        if kinds_[i] == "record" and b'"chain":"tenant:acme"' in line
    )
    body = json.loads(export.lines[last_acme].rsplit(b',"hash"', 1)[0] + b"}")
    head = export.lines[last_acme].rsplit(b'"hash":"', 1)[1][:64].decode()
    body.update(seq=body["seq"] + 1, prev_hash=head, actor="mallory")
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    forged = (text[:-1] + f',"hash":"{hashlib.sha256(text.encode()).hexdigest()}"}}').encode()
    lines = [*export.lines[: last_acme + 1], forged, *export.lines[last_acme + 1 :]]
    report = verify_export(lines, export.public_key_pem)
    assert not report.ok
    assert any("does not match the record before it" in p for p in report.problems)


# ---- hostile input never crashes the verifier --------------------------------------------------


@FUZZ
@given(
    lines=st.lists(
        st.one_of(
            st.text(max_size=60),
            st.binary(max_size=60),
            st.builds(
                lambda v: json.dumps(v) + ',"hash":"' + "a" * 64 + '"}',
                st.recursive(
                    st.none() | st.integers() | st.text(max_size=5),
                    lambda inner: (
                        st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=5), inner, max_size=3)
                    ),
                    max_leaves=8,
                ),
            ),
        ),
        max_size=8,
    ),
    pem=st.one_of(st.binary(max_size=80), st.just(b"")),
)
def test_garbage_is_reported_not_raised(lines: list[str | bytes], pem: bytes) -> None:
    report = verify_export(lines, pem)
    assert not report.ok and report.problems


def test_a_reader_that_fails_midway_is_a_problem(export: Export) -> None:
    def lines() -> Iterator[bytes]:
        yield export.lines[0]
        raise OSError("disk went away")

    report = verify_export(lines(), export.public_key_pem)
    assert not report.ok
    assert any("disk went away" in p for p in report.problems)


def test_problems_are_capped_for_huge_broken_files(export: Export) -> None:
    report = verify_export([b"junk"] * 1000, export.public_key_pem)
    assert not report.ok and len(report.problems) <= 202
    assert report.problems[-1].startswith("... and ")
