"""Two processes appending to one tenant's chain at once produce one valid, gapless chain.

Each child is a fresh interpreter (``spawn``) with its own engine and its own ``AuditLog`` on the
same master key, as two cache nodes would be. SQLite serialises them through ``BEGIN IMMEDIATE``;
PostgreSQL through ``SELECT ... FOR UPDATE`` on the chain's head row.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from multiprocessing.synchronize import Barrier
from pathlib import Path

from sqlalchemy import select

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
from tests.indexes import Index

APPENDS_PER_PROCESS = 40


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


def test_two_processes_append_to_one_chain(tmp_path: Path, index: Index) -> None:
    run_two_appenders(index.database_url(tmp_path / "a.db"), "acme")
