"""``tenantkv job list|show|wait|resume|run``, and how the commands that start a job run it.

A long operation started from the CLI (``datakey retire``, ``purge``, ``tenant delete``,
``gc``) is a job in the index like one started over the admin API: it waits with a progress
bar on stderr (``--json``: the job's final state on stdout, no bar), or with ``--detach``
prints the job id and leaves it to a process of its own (``tenantkv job run ID``, started in a
new session, so it survives the terminal closing). ``job wait`` follows any job, from this host
or the server, by polling its row; ``job resume`` queues an interrupted or failed one again and
runs it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from ..errors import TenantKVError
from .output import add_json, add_root, opened, print_json, progress_bar, table, when

if TYPE_CHECKING:
    from ..api import TenantKV
    from ..services.jobs import JobInfo

#: Seconds between two polls of a job another process runs.
POLL: Final = 0.2


def add_job_options(parser: argparse.ArgumentParser) -> None:
    """``--detach`` and ``--json`` on a command that starts a job."""
    parser.add_argument(
        "--detach",
        action="store_true",
        help="start it as a job in a process of its own and print the job id (see: tenantkv job)",
    )
    add_json(parser)


def run_job(
    kv: TenantKV,
    info: JobInfo,
    args: argparse.Namespace,
    label: str,
    summary: Callable[[dict[str, Any]], str] | None = None,
) -> int:
    """Run a job just started, here with a progress bar, or detached; report how it ended
    (``summary``: the sentence a success prints, from the job's result)."""
    if args.detach:
        _spawn(info.id, args.root)
        if args.json:
            print_json(info)
        else:
            print(info.id)
            print(
                f"job {info.id} ({info.kind}) started; follow it with: tenantkv job wait {info.id}",
                file=sys.stderr,
            )
        return 0
    with progress_bar(label, enabled=not args.json and sys.stderr.isatty()) as bar:
        final = kv.jobs.run(info.id, observer=bar)
    return report(final, args.json, summary)


def report(
    info: JobInfo, as_json: bool, summary: Callable[[dict[str, Any]], str] | None = None
) -> int:
    """Print how a job ended; exit 0 if it succeeded, 1 if not."""
    if as_json:
        print_json(info)
    elif info.state == "succeeded" and summary is not None:
        print(f"{summary(info.result or {})} (job {info.id})")
    elif info.state == "succeeded":
        result = ", ".join(f"{k}={v}" for k, v in sorted((info.result or {}).items()))
        print(f"job {info.id} ({info.kind}{_on(info)}) succeeded: {result}")
    else:
        print(
            f"tenantkv: job {info.id} ({info.kind}{_on(info)}) {info.state}: {info.error}; "
            f"resume it with: tenantkv job resume {info.id}",
            file=sys.stderr,
        )
    return 0 if info.state == "succeeded" else 1


def _on(info: JobInfo) -> str:
    return "" if info.tenant is None else f" of {info.tenant}"


def _spawn(job_id: str, root: str) -> None:
    """``tenantkv job run`` in a new session (no terminal to lose), its output discarded: the
    job's row says how it went."""
    subprocess.Popen(
        [sys.executable, "-m", "tenantkv.cli", "job", "run", job_id, root, "--quiet"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=os.environ.copy(),
    )


def _cmd_list(args: argparse.Namespace) -> int:
    with opened(args.root) as kv:
        jobs = kv.jobs.listing(args.state, args.limit)
    if args.json:
        print_json(jobs)
        return 0
    table(
        "jobs",
        ["id", "kind", "tenant", "state", "progress", "created", "by", "error"],
        [
            (
                j.id,
                j.kind,
                j.tenant or "-",
                j.state,
                f"{j.done}/{'?' if j.total is None else j.total}",
                when(j.created_at),
                j.created_by,
                j.error or "",
            )
            for j in jobs
        ],
    )
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    with opened(args.root) as kv:
        info = kv.jobs.get(args.job_id)
    if args.json:
        print_json(info)
    else:
        _show(info)
    return 0


def _show(info: JobInfo) -> None:
    from .output import fields

    fields(
        [
            ("id", info.id),
            ("kind", info.kind),
            ("tenant", info.tenant),
            ("state", info.state),
            ("progress", f"{info.done}/{'?' if info.total is None else info.total}"),
            ("attempts", info.attempts),
            ("created", f"{when(info.created_at)} by {info.created_by}"),
            ("started", when(info.started_at)),
            ("finished", when(info.finished_at)),
            ("result", info.result),
            ("error", info.error),
        ]
    )


def _cmd_wait(args: argparse.Namespace) -> int:
    with opened(args.root) as kv:
        return report(_follow(kv, args.job_id, args.json), args.json)


def _follow(kv: TenantKV, job_id: str, as_json: bool) -> JobInfo:
    """Poll a job another process runs until it ends, drawing its progress."""
    with progress_bar(f"job {job_id}", enabled=not as_json and sys.stderr.isatty()) as bar:
        while True:
            info = kv.jobs.get(job_id)
            if info.total is not None:
                bar(info.done, info.total)
            if info.finished:
                return info
            time.sleep(POLL)


def _cmd_resume(args: argparse.Namespace) -> int:
    with opened(args.root) as kv:
        info = kv.jobs.resume(args.job_id)
        return run_job(kv, info, args, f"{info.kind} (resumed)")


def _cmd_run(args: argparse.Namespace) -> int:
    """Run a queued job in this process (what ``--detach`` starts)."""
    try:
        with opened(args.root) as kv:
            info = kv.jobs.get(args.job_id)
            with progress_bar(info.kind, enabled=not args.quiet and sys.stderr.isatty()) as bar:
                final = kv.jobs.run(args.job_id, observer=bar)
    except TenantKVError as err:
        if args.quiet:  # a detached runner: the row is where it shows
            return 2
        raise err
    return 0 if args.quiet and final.state == "succeeded" else report(final, as_json=False)


def register(commands: Any) -> None:
    """Add ``job list|show|wait|resume|run`` to the CLI's subcommands."""
    job = commands.add_parser("job", help="follow, list and resume long operations (jobs)")
    actions = job.add_subparsers(dest="job_command", required=True)
    listing = actions.add_parser("list", help="the newest jobs, with state and progress")
    add_root(listing)
    listing.add_argument(
        "--state", choices=("queued", "running", "succeeded", "failed", "interrupted")
    )
    listing.add_argument("--limit", type=int, default=20)
    add_json(listing)
    listing.set_defaults(handler=_cmd_list)
    for name, handler, text in (
        ("show", _cmd_show, "one job's state, progress, result or error"),
        ("wait", _cmd_wait, "follow a job with a progress bar until it ends"),
    ):
        sub = actions.add_parser(name, help=text)
        sub.add_argument("job_id")
        add_root(sub)
        add_json(sub)
        sub.set_defaults(handler=handler)
    resume = actions.add_parser("resume", help="run an interrupted or failed job again")
    resume.add_argument("job_id")
    add_root(resume)
    add_job_options(resume)
    resume.set_defaults(handler=_cmd_resume)
    run = actions.add_parser("run", help="run a queued job in this process (what --detach does)")
    run.add_argument("job_id")
    add_root(run)
    run.add_argument("--quiet", action="store_true", help="no bar and no report (detached)")
    run.set_defaults(handler=_cmd_run)
