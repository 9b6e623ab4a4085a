"""The jobs table (next to the admin tokens', in the same declarative base) and every statement
on it.

A job is a long operation (key retirement, purge, tenant deletion, GC) that outlives the request
that started it: the row is what a client polls, what a restarted server finds, and what a
resume starts again from. Its ``runner`` names the process that runs it (``host:pid``) and its
``heartbeat_at`` is refreshed while it runs, so that a process that died mid-job is recognised:
on its own host by its pid being gone, elsewhere by a heartbeat that stopped
(:func:`running`; ``tenantkv.services.jobs`` decides).
"""

from __future__ import annotations

from sqlalchemy import Float, Index, Integer, String, Text, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from .api_tokens import ServerBase


class Job(ServerBase):
    __tablename__ = "tkv_jobs"
    __table_args__ = (Index("ix_tkv_jobs_state", "state"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    tenant: Mapped[str | None] = mapped_column(String(128))
    params: Mapped[str] = mapped_column(Text)  # JSON: what the operation is called with
    state: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[float] = mapped_column(Float)
    created_by: Mapped[str] = mapped_column(String(256))  # the actor, audited as such
    created_role: Mapped[str] = mapped_column(String(32))
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    heartbeat_at: Mapped[float | None] = mapped_column(Float)
    runner: Mapped[str | None] = mapped_column(String(256))  # host:pid of the running process
    done: Mapped[int] = mapped_column(Integer, default=0)
    total: Mapped[int | None] = mapped_column(Integer)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    result: Mapped[str | None] = mapped_column(Text)  # JSON: what the operation returned
    error: Mapped[str | None] = mapped_column(Text)  # one sentence: why it failed


def add(session: Session, row: Job) -> None:
    session.add(row)
    session.flush()


def get(session: Session, job_id: str, *, lock: bool = False) -> Job | None:
    query = select(Job).where(Job.id == job_id)
    if lock:
        query = query.with_for_update()
    return session.scalar(query)


def listing(session: Session, state: str | None, limit: int) -> list[Job]:
    """The newest ``limit`` jobs (of one ``state`` only, if given)."""
    query = select(Job).order_by(Job.created_at.desc(), Job.id).limit(limit)
    if state is not None:
        query = query.where(Job.state == state)
    return list(session.scalars(query).all())


def running(session: Session) -> list[Job]:
    """Every job whose row says it is running (some may have lost their process)."""
    return list(session.scalars(select(Job).where(Job.state == "running").with_for_update()).all())


def set_progress(session: Session, job_id: str, done: int, total: int | None, now: float) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == "running")
        .values(done=done, total=total, heartbeat_at=now)
        .execution_options(synchronize_session=False)
    )


def heartbeat(session: Session, job_id: str, now: float) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == "running")
        .values(heartbeat_at=now)
        .execution_options(synchronize_session=False)
    )
