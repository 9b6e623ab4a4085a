"""``tenantkv conformance`` without an engine: the verdict rule (a failed control is never a
pass), the report, the SSE and usage parsing, and the suite's matrix driven against a small
in-process model of a deployment (two cache tiers, a salt per identity) whose leaks are
switched on one at a time; each leak must fail exactly its cases, and the isolated model must
pass (the positive control of the suite's own logic). The suite against a real ``vllm serve``
is tests_engines/test_conformance.py."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections import Counter
from typing import Any, ClassVar

import httpx
import pytest

from tenantkv.cli.commands import main
from tenantkv.conformance.ks import ks_2samp
from tenantkv.conformance.probe import Prober, cached_tokens, request_body, sse_events
from tenantkv.conformance.report import (
    CaseResult,
    Outcome,
    Report,
    TimingResult,
    judge,
    timing_outcome,
)
from tenantkv.conformance.suite import (
    AttackMaterial,
    Plan,
    Suite,
    Target,
    prompt,
    timing_round,
)


def test_judge_pairs_each_probe_with_its_control() -> None:
    assert judge(False, True) is Outcome.PASS
    assert judge(True, True) is Outcome.FAIL
    assert judge(True, False) is Outcome.FAIL  # a leak fails whatever the control says
    assert judge(False, False) is Outcome.INCONCLUSIVE  # a miss with no hit to compare
    assert judge(None, True) is Outcome.INCONCLUSIVE  # the probe's hit could not be read
    assert judge(False, None) is Outcome.INCONCLUSIVE
    assert judge(False, True, potent=False) is Outcome.INCONCLUSIVE  # an attack that cannot work
    assert judge(False, True, potent=None) is Outcome.PASS


def test_timing_outcome_needs_the_control_to_separate() -> None:
    assert timing_outcome(0.5, 1e-9) is Outcome.PASS
    assert timing_outcome(1e-4, 1e-9) is Outcome.FAIL
    assert timing_outcome(0.5, 1e-3) is Outcome.INCONCLUSIVE


def test_ks_at_the_audits_sizes() -> None:
    """20 per side: fully separated samples reach the control's p < 1e-6; two samples of one
    distribution stay above the cross-tenant bound."""
    rng = random.Random(7)
    misses = [0.050 + rng.random() * 0.01 for _ in range(20)]
    hits = [0.010 + rng.random() * 0.01 for _ in range(20)]
    assert ks_2samp(hits, misses).p_value < 1e-6
    same = [0.050 + rng.random() * 0.01 for _ in range(20)]
    assert ks_2samp(same, misses).p_value > 1e-3


def _case(outcome: Outcome) -> CaseResult:
    return CaseResult("n", "tenant", "completions", False, "vllm", outcome, "why", 0, 64)


@pytest.mark.parametrize(
    ("outcomes", "failed"),
    [
        ([Outcome.PASS, Outcome.SKIPPED], False),
        ([Outcome.PASS, Outcome.FAIL], True),
        ([Outcome.PASS, Outcome.INCONCLUSIVE], True),
    ],
)
def test_report_fails_on_a_failure_or_an_inconclusive_case(
    outcomes: list[Outcome], failed: bool
) -> None:
    report = Report(target={"gateway": "http://g"}, cases=[_case(o) for o in outcomes])
    assert report.failed is failed
    data = json.loads(report.dumps())
    assert data["passed"] is not failed
    assert [c["outcome"] for c in data["cases"]] == [o.value for o in outcomes]
    assert report.table().splitlines()[-1].startswith("FAILED" if failed else "PASSED")


def test_an_inconclusive_timing_audit_fails_the_report() -> None:
    report = Report(target={}, cases=[_case(Outcome.PASS)])
    report.timing = TimingResult(Outcome.INCONCLUSIVE, 20, cross_p=0.4, control_p=0.01)
    assert report.failed
    assert "same-tenant control p=0.01" in report.table()


def test_usage_and_event_parsing() -> None:
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": 64}}) == 64
    assert cached_tokens({"prompt_tokens_details": None}) is None
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": True}}) is None
    assert cached_tokens(None) is None
    lines = ['data: {"a": 1}', "", ": comment", "data: [DONE]", 'data: {"b": 2}']
    assert list(sse_events(iter(lines))) == [{"a": 1}]
    body = request_body("chat", "m", "hi", stream=True, max_tokens=1, cache_salt="x")
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["cache_salt"] == "x"
    assert body["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError, match="entrypoint"):
        request_body("embeddings", "m", "hi", stream=False, max_tokens=1)


def test_the_clis_entrypoints_are_the_suites() -> None:
    from tenantkv.cli.conformance import ENTRYPOINTS as CLI
    from tenantkv.conformance.probe import ENTRYPOINTS

    assert CLI == ENTRYPOINTS


def test_prompts_are_their_own_from_the_first_characters() -> None:
    a, b = prompt("run1", "x", 300), prompt("run1", "y", 300)
    assert len(a) == len(b) == 300
    assert a[:12] != b[:12] and a != prompt("run2", "x", 300)


# --------------------------------------------------------------------- a model deployment


class ModelDeployment:
    """An OpenAI-shaped deployment with a vLLM-like prefix cache (keyed by the salt the
    "gateway" sets) and a tenantkv-like tier (keyed by the identity the assertion names).
    ``leak`` switches one isolation step off: ``salt`` (the gateway sets no salt), ``scope``
    (the salt and namespace ignore the scope), ``client-salt`` (a client's salt is kept),
    ``assertion`` (a client's assertion is honoured)."""

    KEYS: ClassVar = {"ka": ("acme", "s1"), "kb": ("globex", "s1"), "kc": ("acme", "s2")}
    TOKENS = 96

    def __init__(
        self,
        leak: str | None = None,
        *,
        usage: bool = True,
        prefill: float = 0.0,
        after_miss: float = 0.0,
    ) -> None:
        self.leak = leak
        self.usage = usage  # whether answers report cached tokens
        self.prefill = prefill  # seconds a miss takes (a hit a tenth of it)
        # seconds added to the request after a miss (its store, still running in the background)
        self.after_miss = after_miss
        self.missed_last = False
        self.vllm: set[tuple[str, str, str]] = set()
        self.tenantkv: set[tuple[tuple[str, str], str, str]] = set()
        self.resets = 0

    def identity(self, key: str) -> tuple[str, str]:
        tenant, scope = self.KEYS[key]
        return (tenant, "" if self.leak == "scope" else scope)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/reset_prefix_cache":
            self.vllm.clear()
            self.resets += 1
            return httpx.Response(200, json={"success": True})
        body = json.loads(request.content)
        auth = request.headers.get("authorization", "")
        direct = request.url.host == "backend"
        if direct:  # straight to the engine: only what the body says
            identity = None
            salt = body.get("cache_salt", "")
            params = body.get("kv_transfer_params") or {}
            if params.get("tenantkv_assertion") == "genuine-acme":
                identity = ("acme", "s1")
        else:
            key = auth.removeprefix("Bearer ")
            if key not in self.KEYS:
                return httpx.Response(401, json={"error": {"message": "no"}})
            identity = self.identity(key)
            salt = "" if self.leak == "salt" else "|".join(identity)
            if self.leak == "client-salt" and "cache_salt" in body:
                salt = body["cache_salt"]
            if self.leak == "assertion" and body.get("kv_transfer_params"):
                identity = ("acme", "s1")
        text = body.get("prompt") or json.dumps(body.get("messages"))
        model = body["model"]
        if model not in ("m", "m2"):
            return httpx.Response(404, json={"error": {"message": "unknown model"}})
        hit = (salt, model, text) in self.vllm or (
            identity is not None and (identity, model, text) in self.tenantkv
        )
        self.vllm.add((salt, model, text))
        if identity is not None:
            self.tenantkv.add((identity, model, text))
        time.sleep(
            (self.prefill / 10 if hit else self.prefill)
            + (self.after_miss if self.missed_last else 0.0)
        )
        self.missed_last = not hit
        usage: dict[str, Any] = {"prompt_tokens": self.TOKENS + 1}
        if self.usage:
            usage["prompt_tokens_details"] = {"cached_tokens": self.TOKENS if hit else 0}
        if not body.get("stream"):
            return httpx.Response(200, json={"choices": [{"text": "x"}], "usage": usage})
        events = [{"choices": [{"text": "x"}], "usage": None}, {"choices": [], "usage": usage}]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


def run_suite(
    model: ModelDeployment,
    *,
    backends: bool = True,
    other_model: str | None = "m2",
    plan: Plan | None = None,
) -> Report:
    client = httpx.Client(transport=httpx.MockTransport(model.handle))
    target = Target(
        gateway="http://gateway",
        model="m",
        owner_key="ka",
        other_tenant_key="kb",
        other_scope_key="kc",
        other_model=other_model,
        backends=("http://backend",) if backends else (),
    )
    material = AttackMaterial(
        owner_salt="acme|s1",
        assertions={"replayed": "genuine-acme", "forged": "f", "other-audience": "o"},
    )
    with client:
        plan = plan or Plan(samples=0, prompt_chars=80)
        return Suite(Prober(client), target, plan, material).run()


def failures(report: Report) -> set[str]:
    return {c.name for c in report.cases if c.outcome.fails_the_run}


def test_the_isolated_deployment_passes_every_case() -> None:
    report = run_suite(ModelDeployment())
    assert not report.failed, report.table()
    assert {c.outcome for c in report.cases} == {Outcome.PASS}
    # 3 dimensions x 2 entrypoints x 2 modes x 2 tiers, then 5 attacks
    assert len(report.cases) == 24 + 5
    assert all(c.control_cached == ModelDeployment.TOKENS for c in report.cases)


def test_without_a_gateway_salt_the_vllm_tier_fails() -> None:
    report = run_suite(ModelDeployment(leak="salt"))
    assert report.failed
    bad = failures(report)
    # tenant and scope share one vLLM partition; the tenantkv tier still holds
    assert {n for n in bad if n.startswith(("tenant/", "scope/"))} == {
        f"{d}/{e}/{s}/vllm" for d in ("tenant", "scope") for e in ("completions", "chat")
        for s in ("json", "stream")
    }  # fmt: skip
    assert not any(n.endswith("/tenantkv") for n in bad)


def test_each_leak_fails_its_own_cases() -> None:
    # (the model's owner salt then differs from the material's: its attacks are not judged here)
    scope = {n for n in failures(run_suite(ModelDeployment(leak="scope"))) if "attack" not in n}
    assert scope and all(n.startswith("scope/") for n in scope)
    assert {n.rsplit("/", 1)[1] for n in scope} == {"vllm", "tenantkv"}
    assert failures(run_suite(ModelDeployment(leak="client-salt"))) == {
        "attack/chosen-cache_salt",
        "attack/owner's-cache_salt",
    }
    assert failures(run_suite(ModelDeployment(leak="assertion"))) >= {"attack/replayed-assertion"}


def test_without_backends_the_tenantkv_tier_is_not_faked() -> None:
    report = run_suite(ModelDeployment(), backends=False, other_model=None)
    skipped = [c for c in report.cases if c.outcome is Outcome.SKIPPED]
    assert {c.tier for c in skipped if c.dimension != "model"} == {"tenantkv"}
    assert all("not separated" in c.detail for c in skipped if c.dimension != "model")
    assert any("not separated" in note for note in report.notes)
    assert not report.failed  # skipped is said, not failed; the rest passed
    assert [c for c in report.cases if c.outcome is Outcome.PASS]


def test_a_cache_that_never_hits_is_inconclusive_not_a_pass() -> None:
    class Cold(ModelDeployment):
        def handle(self, request: httpx.Request) -> httpx.Response:
            self.vllm.clear()
            self.tenantkv.clear()
            return super().handle(request)

    report = run_suite(Cold())
    assert report.failed
    assert {c.outcome for c in report.cases} == {Outcome.INCONCLUSIVE}


def test_the_command_exits_nonzero_on_an_unreachable_gateway(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    key = tmp_path / "key"
    key.write_text("ka\n")
    status = main(
        [
            "conformance", "--gateway", "http://127.0.0.1:9", "--model", "m",
            "--owner-key", f"@{key}", "--other-tenant-key", "kb", "--other-scope-key", "kc",
            "--samples", "0", "--timeout", "2",
        ]
    )  # fmt: skip
    assert status == 2
    assert "tenantkv conformance:" in capsys.readouterr().err


TIMED = Plan(
    samples=20, prompt_chars=80, entrypoints=("completions",), streams=(False,), attacks=False
)


def test_the_timing_audit_passes_isolation_and_reads_hits_where_usage_is_silent() -> None:
    """No cached tokens in the answers: the audit's control separates the owner's hits (a
    tenth of a miss's time), so the matrix reads hits from timing, and passes."""
    report = run_suite(ModelDeployment(usage=False, prefill=0.08), plan=TIMED)
    assert report.timing is not None and report.timing.outcome is Outcome.PASS, report.table()
    assert report.timing.control_p is not None and report.timing.control_p < 1e-6
    live = [c for c in report.cases if c.outcome is not Outcome.SKIPPED]
    assert len(live) == 6 and all(c.hits_from == "timing" for c in live)
    assert {c.outcome for c in live} == {Outcome.PASS}, report.table()


def test_the_timing_audits_cross_groups_follow_the_same_requests() -> None:
    """Each cross group follows the owner's miss in half the rounds and the other cross
    request in the rest, and holds each position as often; the hit comes after the store."""
    rounds = [timing_round(i) for i in range(6)]
    before: dict[str, Counter[str]] = {"cross_stored": Counter(), "cross_fresh": Counter()}
    at: dict[str, Counter[int]] = {"cross_stored": Counter(), "cross_fresh": Counter()}
    for sent in rounds:
        groups = [group for group, _ in sent]
        assert groups[0] == "same_fresh" and groups[-1] == "same_hit"
        assert sent[0][1] == sent[-1][1]  # the owner repeats the prompt it stored
        for position, group in enumerate(groups):
            if group in before:
                before[group][groups[position - 1]] += 1
                at[group][position] += 1
    assert before["cross_stored"] == Counter(same_fresh=3, cross_fresh=3)
    assert before["cross_fresh"] == Counter(same_fresh=3, cross_stored=3)
    assert at["cross_stored"] == at["cross_fresh"] == Counter({1: 3, 2: 3})


def test_background_work_after_a_miss_is_not_read_as_a_leak() -> None:
    """A request after a miss is slower (the miss's store still runs). With isolation intact
    the cross groups must not separate: the old order (all three reversed every other round)
    put only ``cross_fresh`` after the owner's hit: KS D >= 0.5, p < 1e-4 at 40, a false FAIL.
    The control still separates (the owner's hit is fast even after a miss)."""
    plan = dataclasses.replace(TIMED, samples=40)
    report = run_suite(ModelDeployment(usage=False, prefill=0.02, after_miss=0.01), plan=plan)
    assert report.timing is not None and report.timing.outcome is Outcome.PASS, report.table()
    assert report.timing.cross_p is not None and report.timing.cross_p > 1e-3


def test_the_timing_audit_fails_a_shared_prefix_cache() -> None:
    report = run_suite(ModelDeployment(leak="salt", usage=False, prefill=0.08), plan=TIMED)
    assert report.timing is not None and report.timing.outcome is Outcome.FAIL, report.table()
    assert report.timing.cross_p is not None and report.timing.cross_p <= 1e-3
    assert report.failed
