"""``tenantkv demo`` end to end (fast mode): its checks hold and its printed claims are computed."""

from __future__ import annotations

import io
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tenantkv.cli import main
from tenantkv.demo import DemoReport, run_demo
from tenantkv.demo.conversation import first_turn, second_turn, tokens_of
from tenantkv.demo.run import _scan_at_rest
from tests.indexes import Index


@pytest.fixture(scope="module")
def demo_run(
    tmp_path_factory: pytest.TempPathFactory, index: Index
) -> tuple[DemoReport, str, Path]:
    root = tmp_path_factory.mktemp("demo") / "cache"
    out = io.StringIO()
    report = run_demo(root, fast=True, new_tokens=6, out=out)
    return report, out.getvalue(), root


def test_every_check_of_the_demo_holds(demo_run: tuple[DemoReport, str, Path]) -> None:
    report, text, _ = demo_run
    assert len(report.checks) == 10
    assert report.passed, text
    assert "demo passed" in text
    assert "[FAILED]" not in text


def test_the_printed_numbers_are_the_measured_ones(demo_run: tuple[DemoReport, str, Path]) -> None:
    report, text, _ = demo_run
    # token counts recomputed here from the conversation and the generated reply
    first, second, other = report.requests
    prompt1 = tokens_of(first_turn(8))
    assert first.prompt_tokens == len(prompt1)
    assert second.prompt_tokens == len(prompt1) + len(first.generated) + len(
        tokens_of(second_turn(8))
    )
    assert second.restored_tokens == (len(prompt1) + len(first.generated) - 1) // 64 * 64
    assert other.prompt_tokens == second.prompt_tokens and other.restored_tokens == 0
    assert report.compared_tokens == 6 == len(second.generated) == len(other.generated)
    assert second.generated == other.generated

    for result in report.requests:
        row = next(line for line in text.splitlines() if line.startswith(f"  │ {result.label} "))
        cells = [cell.strip() for cell in row.strip(" │").split("│")]
        assert cells[1:4] == [
            f"{result.prompt_tokens:,}",
            f"{result.restored_tokens:,}",
            f"{result.computed_tokens:,}",
        ]
        assert cells[5] == f"{result.ttft_s * 1e3:,.0f} ms"
        assert result.ttft_s > 0
    if second.ttft_s <= other.ttft_s:
        assert f"({other.ttft_s / second.ttft_s:.1f}x faster)" in text
    else:
        assert f"({second.ttft_s / other.ttft_s:.1f}x slower" in text
    assert f"{report.identical_tokens}/{report.compared_tokens} identical" in text

    acme = report.usage["acme"]
    assert acme["hit_tokens"] == second.restored_tokens
    assert acme["served_tokens"] == second.restored_tokens
    assert acme["cost_units"] == acme["miss_tokens"] + second.restored_tokens / 50
    assert report.usage["globex"]["hit_tokens"] == 0

    agent = report.agent
    assert agent is not None
    assert agent.edit_context == agent.trim_context == agent.history_tokens - agent.dropped_tokens
    # The old tool outputs all lie in the cached part: drop+repos computes what keeping does.
    assert agent.edit_computed == agent.keep_computed < agent.trim_computed
    row = next(line for line in text.splitlines() if "drop+repos the cache" in line)
    assert f"{agent.edit_computed:,}" in row and f"{agent.edit_context:,}" in row

    assert report.scan is not None
    assert report.scan.files >= 3 and report.scan.bytes_scanned > 0
    assert re.search(rf"searched {report.scan.files} files .* 0 found", text)
    assert report.audit_records[0] == "tenant.create" and "tenant.update" in report.audit_records
    assert f"{len(report.audit_records)} records" in text


def test_the_demo_keeps_its_evidence_in_the_root(demo_run: tuple[DemoReport, str, Path]) -> None:
    _, _, root = demo_run
    export = root / "exports" / "acme-audit.jsonl"
    public_key = root / "exports" / "audit-public-key.pem"
    assert export.exists() and public_key.exists()
    # The kept export verifies with the CLI's offline verifier too; the tampered copy does not.
    assert main(["audit", "verify", str(export), "--public-key", str(public_key)]) == 0
    tampered = root / "exports" / "acme-audit-tampered.jsonl"
    assert main(["audit", "verify", str(tampered), "--public-key", str(public_key)]) == 1


def test_the_at_rest_scan_finds_plaintext_when_there_is_some(tmp_path: Path) -> None:
    """The demo's scan is not vacuous: a file under the root holding a needle is reported."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "clean.bin").write_bytes(b"\x01" * 1000)
    (root / "leaky.bin").write_bytes(b"prefix-" + b"secret tool output" + b"-suffix")
    scan = _scan_at_rest(root, {"tool output": b"secret tool output"}, tmp_path / "control")
    assert scan.found == ["tool output"]
    assert scan.control_found == ["tool output"]
    assert scan.files == 2


def test_the_demo_command_runs_and_refuses_a_used_directory(tmp_path: Path, index: Index) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "something").write_text("x")
    assert main(["demo", str(used), "--fast"]) == 2
    assert main(["demo", "--fast", "--new-tokens", "0"]) == 2
    completed = subprocess.run(
        index.cli("demo", "--fast", "--new-tokens", "3"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "3/3 identical" in completed.stdout
    assert "demo passed" in completed.stdout
