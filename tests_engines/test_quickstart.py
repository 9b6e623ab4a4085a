"""docs/quickstart.md, run as written: every ``sh`` block of the page in order, in one bash
(the way a reader pastes them into one terminal), and its ``python`` block where it stands,
with that shell's ``python``.

The one substitution, which the page states: before the first block the shell exports ``QS``
(a temporary directory), ``MODEL`` (a tiny random Llama and a byte-level tokenizer written there
at test time; nothing is downloaded) and the three ports (free ones); the page's step 1 keeps
values exported before. The page's own CPU block (``VLLM_SERVE``, ``VLLM_ARGS``) runs like the
others: this machine has the CPU build. ``tenantkv`` and ``python`` on the shell's ``PATH`` are
this interpreter (the console scripts of a shared venv may point at another checkout's).

Then the page's claims are checked on what its steps printed: acme's repeated prompt is served
from the cache (``cached_tokens > 0``), globex's identical one is not (``0``), through ``curl``
and through the ``openai`` client; the cache holds the two tenants and stored tokens; and the
page's last step stops every process it started (the shell's process group empties).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

from tests.indexes import Index
from tests.ports import free_ports
from tests_engines.conftest import write_tiny_llama
from tests_engines.tiny_tokenizer import write_tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "quickstart.md"
#: How long one block may run: vllm serve's start on 2 shared cores is the longest.
BLOCK_TIMEOUT = 300.0
#: What steps 7 print, one line per request.
CACHED_LINE = re.compile(r"^(?P<who>[a-z, ]+): (?P<cached>\d+) of (?P<prompt>\d+) prompt tokens")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\S*)\s*$")


@dataclass(frozen=True)
class Block:
    lang: str  # "sh" or "python"
    text: str
    line: int  # where it starts on the page (for failure messages)


def page_blocks(page: Path) -> list[Block]:
    """The fenced ``sh`` and ``python`` blocks of the page, in order (other fences, such as
    the diagram, are not commands)."""
    blocks: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        indent, lang, start = len(opened["indent"]), opened["lang"], i + 1
        end = start
        while not re.match(rf"^ {{{indent}}}```\s*$", lines[end]):
            end += 1
        body = "\n".join(line[indent:] for line in lines[start:end])
        if lang in ("sh", "python"):
            blocks.append(Block(lang, body + "\n", start))
        i = end + 1
    return blocks


class Terminal:
    """One bash fed block after block, as a reader pastes them: exports, functions and
    background jobs carry from one block to the next. Each block runs from a file by
    ``source`` with stdin from /dev/null (so no command of it can read the next block)."""

    def __init__(self, env: dict[str, str], scratch: Path) -> None:
        self.scratch = scratch
        self.process = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: every server the page starts
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.transcript: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.count = 0
        self.run("set -euo pipefail\n", "strict mode")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def run(self, text: str, where: str) -> list[str]:
        """Run ``text`` in the shell; its output lines. The shell exits at a failing command
        (``set -e``), which fails the test with everything it printed."""
        self.count += 1
        script = self.scratch / f"block-{self.count}.sh"
        script.write_text(text, encoding="utf-8")
        marker = f"@@ block {self.count} done"
        assert self.process.stdin is not None
        self.process.stdin.write(f"source {script} < /dev/null\necho '{marker}'\n")
        self.process.stdin.flush()
        output: list[str] = []
        deadline = time.monotonic() + BLOCK_TIMEOUT
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.fail(f"{where} still running after {BLOCK_TIMEOUT:.0f} s", output)
            if line is None:
                self.fail(f"{where} failed (the shell exited {self.process.wait()})", output)
            if line == marker:
                return output
            output.append(line)
            self.transcript.append(line)

    def fail(self, why: str, output: list[str]) -> NoReturn:
        logs = ""
        for log in sorted(self.scratch.glob("qs/*.log")):  # the servers' logs, step by step
            logs += f"\n--- {log.name} (tail)\n" + log.read_text(errors="replace")[-3000:]
        pytest.fail(f"{why}:\n" + "\n".join(output) + logs, pytrace=False)

    def close(self) -> None:
        """End the shell, then whatever of its process group is left (a safety net: the page's
        own last step is what must stop the servers, and the test checks that first)."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        kill_group(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def cached_lines(output: list[str]) -> dict[str, tuple[int, int]]:
    """``who -> (cached tokens, prompt tokens)`` from step 7's lines."""
    found = {}
    for line in output:
        match = CACHED_LINE.match(line)
        if match:
            found[match["who"]] = (int(match["cached"]), int(match["prompt"]))
    return found


def assert_owner_hits_and_other_tenant_misses(output: list[str]) -> None:
    """The page's claim: ``acme, first: 0 of N``, ``acme, again: K of N`` with K > 0,
    ``globex: 0 of N``."""
    seen = cached_lines(output)
    assert seen.keys() == {"acme, first", "acme, again", "globex"}, output
    (first, prompt), (again, prompt_again), (other, prompt_other) = (
        seen["acme, first"],
        seen["acme, again"],
        seen["globex"],
    )
    assert prompt == prompt_again == prompt_other > 0, output
    assert first == 0, output
    assert 0 < again < prompt, output  # served from the cache, the last token computed
    assert other == 0, output  # the same prompt, another tenant: nothing of acme's


@pytest.fixture
def terminal(tmp_path: Path, index: Index) -> Iterator[tuple[Terminal, Path, str]]:
    if not index.is_sqlite and not os.environ.get("TENANTKV_QUICKSTART_POSTGRES"):
        # The page runs on its embedded SQLite index; a PostgreSQL run (the page's variable
        # override, ~100 s more) is opt-in to keep the engine tests within their few minutes.
        # tests_engines/test_hosted_stack.py runs the same stack on PostgreSQL every time.
        pytest.skip("the quickstart on PostgreSQL: set TENANTKV_QUICKSTART_POSTGRES=1")
    qs = tmp_path / "qs"
    qs.mkdir()
    model = write_tiny_tokenizer(write_tiny_llama(qs / "tiny-llama"))
    bin_dir = tmp_path / "bin"  # `tenantkv` and `python` as an install of this checkout has them
    bin_dir.mkdir()
    for name, command in (("tenantkv", "-m tenantkv.cli "), ("python", "")):
        shim = bin_dir / name  # a script, not a link: a venv's python finds its venv by its path
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {command}"$@"\n', encoding="utf-8")
        shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENANTKV_")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    admin_port, vllm_port, gateway_port = free_ports(3)  # three servers, three ports
    env.update(
        QS=str(qs),
        MODEL=str(model),
        ADMIN_PORT=str(admin_port),
        VLLM_PORT=str(vllm_port),
        GATEWAY_PORT=str(gateway_port),
    )
    database_url = index.url(qs / "cache")
    if not database_url.startswith("sqlite"):
        # The page's file keeps the embedded SQLite index; a variable overrides the file
        # (docs/deploy.md), for every command and for the connector inside vllm serve.
        env["TENANTKV_DATABASE_URL"] = database_url
    shell = Terminal(env, tmp_path)
    try:
        yield shell, qs, database_url.split(":", 1)[0]
    finally:
        shell.close()


def test_every_command_of_the_quickstart_runs_and_its_claims_hold(
    terminal: tuple[Terminal, Path, str],
) -> None:
    shell, qs, scheme = terminal
    blocks = page_blocks(PAGE)
    langs = [block.lang for block in blocks]
    assert langs.count("python") == 1 and langs[-1] == "sh", langs  # the snippet, then "Stop"
    printed: list[list[str]] = []
    for block in blocks:
        where = f"docs/quickstart.md line {block.line}"
        started = time.monotonic()
        if block.lang == "sh":
            printed.append(shell.run(block.text, where))
        else:
            snippet = qs / "quickstart.py"
            snippet.write_text(block.text, encoding="utf-8")
            printed.append(shell.run(f'python "{snippet}"\n', where))
        shell.transcript.append(f"@@ {where}: {time.monotonic() - started:.1f} s")
    print("\n".join(shell.transcript))  # what a reader would have seen (shown on a failure)

    everything = [line for lines in printed for line in lines]
    assert any(re.match(r"^ok: .*tenantkv\.toml \(cache, server, gateway, vllm\)$", line)
               for line in everything), everything  # fmt: skip
    # the index the run was meant to use (PostgreSQL: through TENANTKV_DATABASE_URL)
    databases = [line.split()[1] for line in everything if line.startswith("  database ")]
    assert databases and all(url.startswith(f"{scheme}:") for url in databases), databases
    # step 7: curl (the one sh block that prints such lines), then the openai client
    shown = zip(langs, printed, strict=True)
    (curl_output,) = [out for lang, out in shown if lang == "sh" and cached_lines(out)]
    python_output = printed[langs.index("python")]
    assert_owner_hits_and_other_tenant_misses(curl_output)
    assert_owner_hits_and_other_tenant_misses(python_output)
    # `tenantkv info`: the two tenants, and the connector stored prompts in tenantkv
    (info_output,) = [out for b, out in zip(blocks, printed, strict=True) if "info" in b.text]
    info = dict(line.split(None, 1) for line in info_output)
    assert info["tenants"].strip() == "2" and int(info["extents"]) > 0, info
    assert int(info["cached_tokens"]) > 0, info

    # step 8: tenantkv conformance passed (its exit status is checked by the shell's set -e)
    report = json.loads((qs / "conformance.json").read_text(encoding="utf-8"))
    assert report["passed"] and report["counts"]["pass"] >= 6, report
    assert any(line.startswith("PASSED (") for line in everything), everything

    # step 9 stopped every server the page started: the shell's group holds only the shell
    pids = [int(p.read_text()) for p in sorted(qs.glob("*.pid"))]
    assert len(pids) == 3, pids
    shell.process.stdin.close()  # type: ignore[union-attr]
    shell.process.wait(10)
    deadline = time.monotonic() + 60
    while group_alive(shell.process.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not group_alive(shell.process.pid), "a process the page started outlived its kill"
