"""Jobs: long operations (key retirement, purge, tenant deletion, GC) run apart from the
request that started them, with their state and progress in the index.

The synchronous operations stay what they are (``kv.retire_keys``, ``kv.purge``, ...); a job
calls the same service function with a progress callback, in a thread of the process that runs
it (the admin server, or ``tenantkv job run``). The row (``tenantkv.index.jobs``) is the truth
a client polls: ``queued`` -> ``running`` -> ``succeeded`` | ``failed``, or ``interrupted`` when
the process running it died. A running row names its runner (``host:pid``) and carries a
heartbeat, so :meth:`JobService.mark_interrupted` can tell a dead runner on this host (its pid is
gone) and on any host (its heartbeat stopped for :data:`STALE_AFTER` seconds); the admin server
calls it at start, and every read of a running job checks its row.

An interrupted or failed job resumes (:meth:`JobService.resume`) by running its operation again:
each one is idempotent (retirement re-seals what is still on old keys, purge and GC remove what
is still there). A job on a tenant is bound to the tenant it started on (its incarnation): a
tenant deleted, and maybe created again under the name, is never the target of a resumed purge
or retirement, and a resumed deletion whose tenant is already gone has nothing left to do.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from ..audit import Attribution
from ..components.context import CacheContext
from ..errors import (
    InvalidRequestError,
    JobNotFoundError,
    JobStateError,
    TenantKVError,
    TenantNotFoundError,
)
from ..index import jobs as job_rows
from ..index.failures import typed_failures
from ..index.jobs import Job
from ..storage import StorageError
from . import purge, reseal, tenants
from .gc import collect as gc_collect

logger = logging.getLogger("tenantkv")

#: The longest ``orphan_grace`` a GC job takes (the admin API's bound too): 30 days.
MAX_ORPHAN_GRACE: Final = 30 * 86400.0

JobKind = Literal["keys.retire", "purge", "tenant.delete", "gc"]
JOB_KINDS: Final[tuple[JobKind, ...]] = ("keys.retire", "purge", "tenant.delete", "gc")
JobState = Literal["queued", "running", "succeeded", "failed", "interrupted"]
#: States a job can be resumed from.
RESUMABLE: Final = ("interrupted", "failed")
#: Seconds between two heartbeats of a running job.
HEARTBEAT: Final = 5.0
#: A running job whose heartbeat is this old has lost its runner (on any host).
STALE_AFTER: Final = 6 * HEARTBEAT
#: Least seconds between two progress writes of one job (the first and last are always written).
PROGRESS_EVERY: Final = 0.25
#: Observer of a job run in this process: ``(done, total)`` as the operation reports them.
Progress = Callable[[int, int], None]
#: Ids of the jobs this process is running (any cache handle of it): a running row naming this
#: process whose id is not here lost its thread.
_ACTIVE: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


@dataclass(frozen=True)
class JobInfo:
    """What a client sees of a job."""

    id: str
    kind: str
    tenant: str | None
    state: str
    created_at: float
    created_by: str
    started_at: float | None
    finished_at: float | None
    done: int
    total: int | None
    attempts: int
    result: dict[str, Any] | None
    error: str | None

    @property
    def finished(self) -> bool:
        return self.state in ("succeeded", "failed", "interrupted")


def _info(row: Job) -> JobInfo:
    return JobInfo(
        id=row.id,
        kind=row.kind,
        tenant=row.tenant,
        state=row.state,
        created_at=row.created_at,
        created_by=row.created_by,
        started_at=row.started_at,
        finished_at=row.finished_at,
        done=row.done,
        total=row.total,
        attempts=row.attempts,
        result=None if row.result is None else json.loads(row.result),
        error=row.error,
    )


def this_runner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


@typed_failures
class JobService:
    """Jobs over one open cache's components (``kv.jobs``)."""

    def __init__(self, ctx: CacheContext) -> None:
        self._ctx = ctx
        self._runner = this_runner()
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}

    # ---- starting -----------------------------------------------------------------------------

    def start(
        self,
        kind: str,
        tenant: str | None = None,
        params: Mapping[str, Any] | None = None,
        *,
        by: Attribution | None = None,
    ) -> JobInfo:
        """Record a queued job (nothing runs yet: :meth:`run` or :meth:`run_in_background`).

        A job on a tenant checks the tenant exists now (TenantNotFoundError) and is bound to its
        incarnation; ``params`` are the operation's (``scope`` for a purge, ``orphan_grace`` for
        GC)."""
        if kind not in JOB_KINDS:
            raise InvalidRequestError(f"job kind {kind!r} must be one of {', '.join(JOB_KINDS)}")
        checked = dict(params or {})
        if (kind == "gc") != (tenant is None):
            raise InvalidRequestError(
                f"a {kind} job {'takes no' if kind == 'gc' else 'needs a'} tenant"
            )
        if kind == "gc" and checked.get("orphan_grace") is not None:
            checked["orphan_grace"] = _orphan_grace(checked["orphan_grace"])
        if tenant is not None:
            incarnation = tenants.current_incarnation(self._ctx, tenant)
            if incarnation is None:
                raise TenantNotFoundError(f"no tenant named {tenant!r}")
            checked["incarnation"] = incarnation.incarnation
        actor = by or self._ctx.attribution
        row = Job(
            id=secrets.token_hex(8),
            kind=kind,
            tenant=tenant,
            params=json.dumps(checked, sort_keys=True),
            state="queued",
            created_at=self._ctx.clock(),
            created_by=actor.actor,
            created_role=actor.role,
            done=0,
            total=None,
            attempts=0,
        )
        with self._ctx.index.write() as session:
            job_rows.add(session, row)
            return _info(row)

    def run_in_background(self, job_id: str) -> None:
        """Run a queued job in a thread of this process: it goes on whatever happens to the
        request (or client) that asked for it."""
        thread = threading.Thread(
            target=self._run_logged, args=(job_id,), name=f"tenantkv-job-{job_id}", daemon=True
        )
        with self._lock:
            self._threads[job_id] = thread
        thread.start()

    def _run_logged(self, job_id: str) -> None:
        try:
            self.run(job_id)
        except Exception:  # recorded in the row where the index allowed; never lost silently
            logger.exception("job %s failed outside its operation", job_id)
        finally:
            with self._lock:
                self._threads.pop(job_id, None)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the jobs this process runs in the background (tests; an orderly close)."""
        with self._lock:
            threads = list(self._threads.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    # ---- running ------------------------------------------------------------------------------

    def run(self, job_id: str, observer: Progress | None = None) -> JobInfo:
        """Run a queued job here and now, to its end; return its final state. A failure of the
        operation is recorded in the row (state ``failed``, one sentence) and returned, not
        raised; ``observer`` sees every progress report (a CLI's progress bar)."""
        row = self._claim(job_id)
        with _ACTIVE_LOCK:
            _ACTIVE.add(job_id)
        try:
            return self._run_claimed(row, observer)
        finally:
            with _ACTIVE_LOCK:
                _ACTIVE.discard(job_id)

    def _run_claimed(self, row: Job, observer: Progress | None) -> JobInfo:
        job_id = row.id
        params = json.loads(row.params)
        by = Attribution(row.created_by, row.created_role)
        progress = _ProgressWriter(self._ctx, job_id, observer)
        beat = _Heartbeat(self._ctx, job_id)
        beat.start()
        try:
            result = self._operate(row.kind, row.tenant, params, by, progress)
        except (TenantKVError, StorageError) as err:
            return self._finish(job_id, "failed", None, str(err))
        except Exception as err:
            logger.exception("job %s (%s) failed", job_id, row.kind)
            return self._finish(job_id, "failed", None, f"{type(err).__name__}: {err}")
        finally:
            beat.stop()
        progress.flush()
        return self._finish(job_id, "succeeded", result, None)

    def _claim(self, job_id: str) -> Job:
        with self._ctx.index.write() as session:
            row = job_rows.get(session, job_id, lock=True)
            if row is None:
                raise JobNotFoundError(f"no job {job_id}")
            if row.state != "queued":
                raise JobStateError(f"job {job_id} is {row.state}, not queued")
            now = self._ctx.clock()
            row.state = "running"
            row.runner = self._runner
            row.started_at = now
            row.heartbeat_at = now
            row.attempts += 1
            row.error = None
            session.flush()
            session.expunge(row)
            return row

    def _operate(
        self,
        kind: str,
        tenant: str | None,
        params: dict[str, Any],
        by: Attribution,
        progress: _ProgressWriter,
    ) -> dict[str, Any]:
        ctx = self._ctx
        if kind == "gc":
            grace = params.get("orphan_grace")
            report = gc_collect(
                ctx,
                orphan_grace=ctx.config.orphan_grace if grace is None else float(grace),
                progress=progress,
            )
            return dict(report.__dict__)
        assert tenant is not None, "a tenant job without a tenant"
        current = tenants.current_incarnation(ctx, tenant)
        same = current is not None and current.incarnation == params["incarnation"]
        if kind == "tenant.delete":
            if not same:  # a resumed deletion that already went through
                progress(1, 1)
                return {"extents_removed": 0, "already_deleted": True}
            return {"extents_removed": tenants.delete_tenant(ctx, tenant, by, progress)}
        if not same:
            raise TenantNotFoundError(
                f"tenant {tenant!r} was deleted after the job started (a tenant of that name "
                "now is another one)"
            )
        if kind == "purge":
            purged = purge.purge(ctx, by, tenant, params.get("scope"), progress)
            return dict(purged.__dict__)
        return reseal.retire_keys(ctx, tenant, by, progress)

    def _finish(
        self, job_id: str, state: JobState, result: dict[str, Any] | None, error: str | None
    ) -> JobInfo:
        with self._ctx.index.write() as session:
            row = job_rows.get(session, job_id, lock=True)
            if row is None:
                raise JobNotFoundError(f"no job {job_id}")
            row.state = state
            row.finished_at = self._ctx.clock()
            row.result = None if result is None else json.dumps(result, sort_keys=True)
            row.error = error
            if state == "succeeded" and row.total is None:
                row.total = row.done
            session.flush()
            return _info(row)

    # ---- reading, recovering ------------------------------------------------------------------

    def get(self, job_id: str) -> JobInfo:
        """The job's state and progress; a running job whose runner died is marked interrupted
        first (so a client polling a job of a crashed node learns it)."""
        with self._ctx.index.read() as session:
            row = job_rows.get(session, job_id)
            if row is None:
                raise JobNotFoundError(f"no job {job_id}")
            info = _info(row)
            lost = row.state == "running" and self._lost(row, self._ctx.clock())
        if lost:
            self.mark_interrupted()
            return self.get(job_id)
        return info

    def listing(self, state: str | None = None, limit: int = 50) -> list[JobInfo]:
        """The newest ``limit`` jobs (of one ``state`` only, if given)."""
        if not 0 < limit <= 1000:
            raise InvalidRequestError("limit must be more than 0 and at most 1000")
        with self._ctx.index.read() as session:
            return [_info(row) for row in job_rows.listing(session, state, limit)]

    def mark_interrupted(self) -> list[str]:
        """Mark every running job whose runner is gone as interrupted; return their ids. A
        server calls it at start: its own jobs of before the restart are among them."""
        now = self._ctx.clock()
        marked: list[str] = []
        with self._ctx.index.write() as session:
            for row in job_rows.running(session):
                if self._lost(row, now):
                    row.state = "interrupted"
                    row.finished_at = now
                    row.error = f"its runner {row.runner} stopped before it finished"
                    marked.append(row.id)
        for job_id in marked:
            logger.warning("job %s was interrupted (its runner stopped); it can be resumed", job_id)
        return marked

    def _lost(self, row: Job, now: float) -> bool:
        if row.heartbeat_at is None or now - row.heartbeat_at > STALE_AFTER:
            return True
        host, _, pid = (row.runner or "").rpartition(":")
        if host != socket.gethostname() or not pid.isdigit():
            return False  # another host: its heartbeat says
        if int(pid) == os.getpid():
            with _ACTIVE_LOCK:
                return row.id not in _ACTIVE
        return not _pid_alive(int(pid))

    def resume(self, job_id: str) -> JobInfo:
        """Queue an interrupted or failed job again (JobStateError for any other state); run it
        with :meth:`run` or :meth:`run_in_background`. Its progress starts over."""
        self.mark_interrupted()
        with self._ctx.index.write() as session:
            row = job_rows.get(session, job_id, lock=True)
            if row is None:
                raise JobNotFoundError(f"no job {job_id}")
            if row.state not in RESUMABLE:
                raise JobStateError(
                    f"job {job_id} is {row.state}; only an interrupted or failed job resumes"
                )
            row.state = "queued"
            row.done = 0
            row.total = None
            row.finished_at = None
            row.runner = None
            session.flush()
            return _info(row)


class _ProgressWriter:
    """The progress callback handed to an operation: writes ``(done, total)`` to the job's row
    at most every :data:`PROGRESS_EVERY` seconds (an operation may report thousands of steps;
    the index takes one small write per interval), and tells an observer every step."""

    def __init__(self, ctx: CacheContext, job_id: str, observer: Progress | None) -> None:
        self._ctx = ctx
        self._job_id = job_id
        self._observer = observer
        self._written_at = float("-inf")
        self._last: tuple[int, int] | None = None
        self._written: tuple[int, int] | None = None

    def __call__(self, done: int, total: int) -> None:
        self._last = (done, total)
        if self._observer is not None:
            self._observer(done, total)
        now = time.monotonic()
        if now - self._written_at >= PROGRESS_EVERY or done >= total:
            self._write(now)

    def _write(self, now: float) -> None:
        assert self._last is not None
        with self._ctx.index.write() as session:
            job_rows.set_progress(session, self._job_id, *self._last, self._ctx.clock())
        self._written_at = now
        self._written = self._last

    def flush(self) -> None:
        if self._last is not None and self._last != self._written:
            self._write(time.monotonic())


class _Heartbeat:
    """Refreshes a running job's heartbeat every :data:`HEARTBEAT` seconds from a thread, so a
    long step without progress reports (one large extent) does not read as a dead runner."""

    def __init__(self, ctx: CacheContext, job_id: str) -> None:
        self._ctx = ctx
        self._job_id = job_id
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name=f"tenantkv-job-beat-{job_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            try:
                with self._ctx.index.write() as session:
                    job_rows.heartbeat(session, self._job_id, self._ctx.clock())
            except Exception:  # the next beat tries again; a long outage reads as interrupted
                logger.warning("job %s: heartbeat failed", self._job_id, exc_info=True)


def _orphan_grace(value: Any) -> float:
    """A GC job's ``orphan_grace``, checked when the job is made rather than when it runs (a
    detached job would fail long after the command returned): seconds, 0 to 30 days."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"orphan_grace must be a number of seconds, got {value!r}")
    grace = float(value)
    if not 0 <= grace <= MAX_ORPHAN_GRACE:  # NaN fails both comparisons
        raise InvalidRequestError(
            f"orphan_grace must be from 0 to {int(MAX_ORPHAN_GRACE)} seconds (30 days), "
            f"got {value!r}"
        )
    return grace
