"""Every Python and shell block of the README and docs/ runs as written, or says it will not.

A fenced block in ``python``, ``bash``, ``sh``, ``shell`` or ``console`` is *runnable* unless
the line just above its opening fence is ``<!-- fragment -->`` (a piece of a larger program, or
one that needs what a test cannot have: vLLM, a GPU, root on a fleet's hosts, hours of
benchmark). ``<!-- continues -->`` above a Python block runs it in the same process as the block
before it on the page (the reader's session goes on). docs/quickstart.md is run whole by
``tests_engines/test_quickstart.py`` (it needs vLLM's CPU build), so it is left out here.

How they run, per page:

- each Python block (with the blocks that continue it) in a new interpreter of this venv, in a
  fresh empty directory (``./cache`` is that block's own);
- every shell block of the page, in order, in one ``bash`` (``set -eo pipefail``), as a reader's
  terminal would, in one directory, with this venv's ``bin`` first on ``PATH``; what it starts in
  the background is ended with it.

The docs name a deployment's services; the test gives them its own (the test fixtures): each
name in :data:`SERVICES` is replaced, before running, by a PostgreSQL schema of this session, a
Redis key prefix of this test, or a directory under the test's temporary one. A page whose
blocks fail names the block (page and line) and its output.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.block_stores import drop_prefix, new_prefix
from tests.conftest import selected_index_kinds
from tests.indexes import PostgresSchemas

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
RUN_ELSEWHERE = {"docs/quickstart.md": "tests_engines/test_quickstart.py runs it with vLLM"}
KINDS = {"python": "python", "bash": "shell", "sh": "shell", "shell": "shell", "console": "shell"}
FRAGMENT = "<!-- fragment -->"
CONTINUES = "<!-- continues -->"
_FENCE = re.compile(r"^```(\w*)\s*$")
#: The services and paths the docs name, as they appear in them.
SERVICES = (
    "postgresql+psycopg://kv@db/kv",
    "redis://host:6379/0?prefix=tkv:",
    "/var/lib/tenantkv",
    "file:///mnt/kv",
)
#: Seconds a page may take (every block together); the runs are small, the machine shared.
PAGE_TIMEOUT = 240


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    kind: str  # "python" | "shell"
    source: str
    fragment: bool
    continues: bool

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """The Python and shell blocks of ``page``, in order, with their markers."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        kind = KINDS.get(opening.group(1))
        above = next((lines[i].strip() for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        if kind is not None:
            found.append(
                Block(
                    page=page,
                    line=index + 1,
                    kind=kind,
                    source="\n".join(lines[index + 1 : end]) + "\n",
                    fragment=above == FRAGMENT,
                    continues=above == CONTINUES,
                )
            )
        index = end + 1
    return found


def runnable(page: str) -> list[Block]:
    return [b for b in blocks(page) if not b.fragment]


def test_markers_stand_above_a_block_and_continuations_follow_python() -> None:
    """A marker that names no block would leave a block runnable that its writer meant as a
    fragment; a continuation needs a Python block before it."""
    for page in PAGES:
        lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if line.strip() in (FRAGMENT, CONTINUES):
                following = next((x for x in lines[number + 1 :] if x.strip()), "")
                assert _FENCE.match(following), f"{page}:{number + 1}: a marker above no block"
        previous: Block | None = None
        for block in blocks(page):
            if block.continues:
                assert block.kind == "python", f"{block.where}: only Python blocks continue"
                assert previous is not None and previous.kind == "python", block.where
                assert not previous.fragment, f"{block.where} continues a fragment"
            previous = block


def test_there_is_something_to_run() -> None:
    """The positive control of the runs below: most of the README runs."""
    readme = runnable("README.md")
    assert sum(b.kind == "python" for b in readme) >= 5
    assert sum(b.kind == "shell" for b in readme) >= 1


def _python_groups(page_blocks: list[Block]) -> list[list[Block]]:
    groups: list[list[Block]] = []
    for block in page_blocks:
        if block.kind != "python":
            continue
        if block.continues and groups:
            groups[-1].append(block)
        else:
            groups.append([block])
    return groups


def _environment(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENANTKV_")}
    env["TENANTKV_CPU_CLAIM_DIR"] = str(tmp / "cpus")  # the machine's claims are not ours
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(tmp / "home")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    with socket.socket() as probe:  # the admin server a page starts listens on a free port
        probe.bind(("127.0.0.1", 0))
        env["TENANTKV_PORT"] = str(probe.getsockname()[1])
    (tmp / "home").mkdir(exist_ok=True)
    return env


def _run(command: list[str], cwd: Path, env: dict[str, str], what: str) -> None:
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # what the block starts in the background ends with it
    )
    try:
        output, _ = process.communicate(timeout=PAGE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{what} ran past {PAGE_TIMEOUT} s:\n{output[-4000:]}", pytrace=False)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    if process.returncode != 0:
        pytest.fail(f"{what} failed ({process.returncode}):\n{output[-6000:]}", pytrace=False)


@pytest.fixture
def services(tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    """What each name of :data:`SERVICES` stands for in this test: the PostgreSQL index is a
    schema of this session's, or, run with ``--index=sqlite`` (no server), a SQLite file."""
    var_lib = tmp_path / "var-lib-tenantkv"
    if "postgresql" in selected_index_kinds(request.config):
        schemas: PostgresSchemas = request.getfixturevalue("postgres_schemas")
        schemas.connect()
        index_url = schemas.url(str(var_lib))
    else:
        index_url = f"sqlite:///{tmp_path / 'fleet-index.db'}"
    prefix = new_prefix()
    request.addfinalizer(lambda: drop_prefix(prefix))
    mnt = tmp_path / "mnt-kv"
    mnt.mkdir()
    return {
        "postgresql+psycopg://kv@db/kv": index_url,
        "redis://host:6379/0?prefix=tkv:": f"redis://127.0.0.1:6379/0?prefix={prefix}",
        "/var/lib/tenantkv": str(var_lib),
        "file:///mnt/kv": mnt.as_uri(),
    }


def _with_services(source: str, services: dict[str, str]) -> str:
    for name in SERVICES:
        source = source.replace(name, services[name])
    return source


@pytest.mark.parametrize(
    "page", [p for p in PAGES if p not in RUN_ELSEWHERE and runnable(p)], ids=str
)
def test_page_runs_as_written(page: str, tmp_path: Path, services: dict[str, str]) -> None:
    env = _environment(tmp_path)
    page_blocks = runnable(page)
    # An existing deployment's root, as the pages about upgrading and fleets assume one.
    if any("/var/lib/tenantkv" in b.source for b in page_blocks):
        _run(
            [sys.executable, "-m", "tenantkv.cli", "init", services["/var/lib/tenantkv"]],
            tmp_path,
            env,
            "tenantkv init of the test's /var/lib/tenantkv",
        )
    for number, group in enumerate(_python_groups(page_blocks)):
        workdir = tmp_path / f"python-{number}"
        workdir.mkdir()
        script = workdir.parent / f"block-{number}.py"
        script.write_text(
            "\n".join(_with_services(b.source, services) for b in group), encoding="utf-8"
        )
        where = " + ".join(b.where for b in group)
        _run([sys.executable, str(script)], workdir, env, f"the Python block at {where}")
    shell = [b for b in page_blocks if b.kind == "shell"]
    if shell:
        workdir = tmp_path / "shell"
        workdir.mkdir()
        script = tmp_path / "blocks.sh"
        parts = ["set -eo pipefail"]
        for block in shell:
            parts.append(f"echo '### {block.where}' >&2")
            parts.append(_with_services(block.source, services))
        script.write_text("\n".join(parts), encoding="utf-8")
        bash = shutil.which("bash")
        assert bash is not None
        where = ", ".join(b.where for b in shell)
        _run([bash, str(script)], workdir, env, f"the shell blocks at {where}")
