"""Two processes appending to one tenant's chain at once produce one valid, gapless chain.

Each child is a fresh interpreter (``spawn``) with its own engine and its own ``AuditLog`` on the
same master key, as two cache nodes would be. SQLite serialises them through ``BEGIN IMMEDIATE``;
PostgreSQL through ``SELECT ... FOR UPDATE`` on the chain's head row.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import uuid
from collections import Counter
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from tenantkv.audit import (
    GENESIS_HASH,
    TENANT_UPDATE,
    AuditBase,
    AuditEvent,
    AuditLog,
    AuditRecordRow,
    chain_for,
    verify_export,
)
from tenantkv.crypto import KeyEncryptionKey
from tenantkv.index.database import Database

APPENDS_PER_PROCESS = 40
POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def append_many(url: str, master_key: bytes, tenant: str, actor: str, barrier: Barrier) -> None:
    """Child process: one transaction per append, like one admin action after another."""
    db = Database(url)
    log = AuditLog(KeyEncryptionKey(master_key))
    try:
        barrier.wait(timeout=60)
        for i in range(APPENDS_PER_PROCESS):
            with db.write() as session:
                log.append(
                    session,
                    AuditEvent(
                        actor=actor,
                        role="operator",
                        tenant=tenant,
                        action=TENANT_UPDATE,
                        target=f"{actor}-{i}",
                    ),
                )
    finally:
        db.close()


def run_two_appenders(url: str, tenant: str) -> None:
    master_key = os.urandom(32)
    setup = Database(url)
    try:
        AuditBase.metadata.create_all(setup.engine)
    finally:
        setup.close()
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    children = [
        context.Process(target=append_many, args=(url, master_key, tenant, actor, barrier))
        for actor in ("node-a", "node-b")
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=120)
    codes = [child.exitcode for child in children]
    assert codes == [0, 0], f"an appender process failed (exit codes {codes})"

    db = Database(url)
    log = AuditLog(KeyEncryptionKey(master_key))
    chain = chain_for(tenant)
    try:
        with db.read() as session:
            rows = list(
                session.execute(
                    select(AuditRecordRow.seq, AuditRecordRow.actor, AuditRecordRow.prev_hash)
                    .where(AuditRecordRow.chain == chain)
                    .order_by(AuditRecordRow.seq)
                )
            )
        total = 2 * APPENDS_PER_PROCESS
        assert [row.seq for row in rows] == list(range(1, total + 1)), "the chain has gaps"
        assert rows[0].prev_hash == GENESIS_HASH
        assert Counter(row.actor for row in rows) == {
            "node-a": APPENDS_PER_PROCESS,
            "node-b": APPENDS_PER_PROCESS,
        }
        with db.write() as session:
            pem = log.public_key_pem(session)
        report = verify_export(log.export(db.read, tenant=tenant), pem)
        assert report.ok, report.problems
        assert report.records == total
    finally:
        db.close()


def test_two_processes_append_to_one_chain_on_sqlite(tmp_path: Path) -> None:
    run_two_appenders(f"sqlite:///{tmp_path}/a.db", "acme")


def _postgres_skip_reason() -> str | None:
    if importlib.util.find_spec("psycopg") is None:
        return (
            "psycopg (the PostgreSQL driver) is not installed in this environment, so the "
            f"PostgreSQL variant against {POSTGRES_URL} cannot run"
        )
    probe = Database(POSTGRES_URL)
    try:
        with probe.engine.connect():
            return None
    except OperationalError as err:
        return f"PostgreSQL at {POSTGRES_URL} is not reachable: {err}"
    finally:
        probe.close()


def test_two_processes_append_to_one_chain_on_postgresql() -> None:
    reason = _postgres_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    # a fresh tenant per run: the shared database keeps other runs' chains
    run_two_appenders(POSTGRES_URL, f"mp-{uuid.uuid4().hex[:12]}")
