"""``tenantkv conformance`` against the hosted stack (the session's one ``vllm serve`` behind the
gateway, tests_engines/hosted.py), run as an operator runs it: the command in a child
process, with the deployment's configuration file, keys of two tenants and of a second scope,
and the backend's URL for ``POST /reset_prefix_cache``.

Its positive control: the same command against the same stack behind a gateway whose salt
step is switched off (the app's rewrite wrapped in the test; no configuration can do it) must
fail, on exactly the cases of vLLM's prefix cache, while the tenantkv tier (the assertion, not
the salt) still passes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tenantkv.cli.gateway import _authenticator, build_gateway, gateway_options
from tests.gateway_stack import serving
from tests_engines.hosted import MODEL, REPO, Stack

#: Small enough for the engine suite's budget, long enough to span several blocks (the matrix)
#: and to make a hit's prefill visibly shorter (the timing audit: ~930 tokens of 1024).
PROMPT_CHARS, TIMING_CHARS = 200, 1400
#: Per group of the timing audit. 20 reach the control's p < 1e-6 when hits and misses separate
#: fully (KS D = 1); on a 2-core machine shared with others' jobs a third of the hits can be
#: slowed past the misses (D = 0.67 at 30 in CI: p = 3.2e-6, inconclusive); 60 take D >= 0.5,
#: for about 5 s more.
SAMPLES = 60


@pytest.fixture(scope="module")
def key_files(hosted_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three keys as files (``@FILE``): acme's, globex's and acme's of another scope."""
    base = tmp_path_factory.mktemp("conformance-keys")
    _, other_scope = hosted_stack.kv.inference_keys.create("acme", "conf", scope="team-b")
    keys = {**hosted_stack.keys, "acme-b": other_scope}
    files = {}
    for name, key in keys.items():
        files[name] = base / name
        files[name].write_text(key + "\n", encoding="utf-8")
    return files


def conformance(
    stack: Stack, gateway: str, keys: dict[str, Path], report: Path, *extra: str
) -> tuple[int, dict[str, Any], str]:
    """Run ``tenantkv conformance`` in a child process; its exit status, JSON report, table."""
    command = [
        sys.executable, "-m", "tenantkv.cli", "conformance",
        "--config", str(stack.config_file),
        "--gateway", gateway, "--model", MODEL,
        "--owner-key", f"@{keys['acme']}",
        "--other-tenant-key", f"@{keys['globex']}",
        "--other-scope-key", f"@{keys['acme-b']}",
        "--backend", stack.vllm,
        "--prompt-chars", str(PROMPT_CHARS), "--timing-chars", str(TIMING_CHARS),
        "--json", str(report), *extra,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert report.exists(), done.stdout + done.stderr
    return done.returncode, json.loads(report.read_text(encoding="utf-8")), done.stdout


def outcomes(report: dict[str, Any], keep: Callable[[dict[str, Any]], bool]) -> set[str]:
    return {case["outcome"] for case in report["cases"] if keep(case)}


def test_conformance_passes_against_the_hosted_stack(
    hosted_stack: Stack, key_files: dict[str, Path], tmp_path: Path
) -> None:
    status, report, table = conformance(
        hosted_stack, hosted_stack.gateway, key_files, tmp_path / "report.json",
        "--samples", str(SAMPLES),
    )  # fmt: skip
    assert status == 0, table
    assert report["passed"], table
    # every tenant and scope case ran on both tiers and passed, with its control's hit
    identity = [c for c in report["cases"] if c["dimension"] in ("tenant", "scope")]
    assert len(identity) == 16
    assert {c["outcome"] for c in identity} == {"pass"}, table
    assert all(c["control_cached"] > 0 and c["probe_cached"] == 0 for c in identity), table
    assert {c["tier"] for c in identity} == {"vllm", "tenantkv"}
    # no second model is served here: said, not passed
    assert outcomes(report, lambda c: c["dimension"] == "model") == {"skipped"}
    # the five attacks ran (the configuration file gave the owner's salt and assertions)
    attacks = [c for c in report["cases"] if c["dimension"].startswith("attack:")]
    assert len(attacks) == 5 and {c["outcome"] for c in attacks} == {"pass"}, table
    timing = report["timing"]
    assert timing["outcome"] == "pass", table
    assert timing["cross_p"] > 1e-3 and timing["control_p"] < 1e-6


def test_conformance_fails_when_the_gateway_sets_no_salt(
    hosted_stack: Stack, key_files: dict[str, Path], tmp_path: Path
) -> None:
    options = gateway_options(
        str(hosted_stack.kv.config.root), config_file=str(hosted_stack.config_file)
    )
    app = build_gateway(hosted_stack.kv, options, _authenticator)
    gateway = app.state.gateway
    rewrite = gateway.rewrite

    def unsalted(body: dict[str, Any], identity: Any) -> bytes:
        """The real rewrite (strip, salt, sign), then the salt taken out again."""
        rewritten = json.loads(rewrite(body, identity))
        assert rewritten.pop("cache_salt")
        return json.dumps(rewritten).encode("utf-8")

    gateway.rewrite = unsalted
    with serving(app) as url:
        status, report, table = conformance(
            hosted_stack, url, key_files, tmp_path / "report.json", "--samples", "0",
            "--entrypoint", "completions", "--streaming", "off", "--no-attacks",
        )  # fmt: skip
    assert status == 1, table
    assert not report["passed"]
    identity = [c for c in report["cases"] if c["dimension"] in ("tenant", "scope")]
    assert len(identity) == 4  # tenant and scope x the two tiers (one entrypoint, unstreamed)
    # vLLM's own prefix cache is shared now: every identity case of that tier fails ...
    assert {c["outcome"] for c in identity if c["tier"] == "vllm"} == {"FAIL"}, table
    # ... while tenantkv's tier, partitioned by the assertion, still holds
    assert {c["outcome"] for c in identity if c["tier"] == "tenantkv"} == {"pass"}, table
