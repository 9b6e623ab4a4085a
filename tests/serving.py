"""``tenantkv serve`` as a real child process: start it on a free port, wait for ``/healthz``,
stop it, and hand back what it printed (for tests of what reaches a server's logs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.ports import free_port


@dataclass(frozen=True)
class ServeRun:
    """How a ``tenantkv serve`` child ended: its exit status, whether ``/healthz`` answered 200
    while it ran, and everything it wrote to stdout and stderr."""

    returncode: int
    served: bool
    output: str


def cli_env(database_url: str) -> dict[str, str]:
    """The environment of a ``tenantkv`` child using the index at ``database_url`` (what the
    ``index`` fixture gives the in-process CLI)."""
    return {**os.environ, "TENANTKV_DATABASE_URL": database_url}


def run_serve(root: Path, database_url: str, *, start_timeout: float = 60.0) -> ServeRun:
    """Run ``tenantkv serve root`` until ``/healthz`` answers (then stop it with SIGINT, as an
    operator's Ctrl-C or systemd would) or the child exits by itself, whichever comes first."""
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, "-m", "tenantkv.cli", "serve", str(root), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(database_url),
    )
    served = False
    deadline = time.monotonic() + start_timeout
    try:
        while child.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    served = r.status == 200
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
                continue
            break
        if child.poll() is None:
            child.send_signal(signal.SIGINT)
        output, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    return ServeRun(returncode=child.returncode, served=served, output=output)
