"""The timing side-channel audit (``bench/timing_audit.py``) and its KS test
(``tenantkv.conformance.ks``, imported by ``bench/_ks.py``).

Speed is never checked here (machines are noisy; the audit itself is a benchmark). What is
checked is that the audit cannot pass vacuously: its KS code gives known values, its probes
are classified as they must be (the owner's shared probes do hit and load, the other
tenant's and scope's do not), and its verdicts fail when the positive control is blind or a
cross-namespace timing differs.
"""

from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tenantkv import KVLayout
from tests.indexes import Index

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench_module(name: str) -> ModuleType:
    """Import a bench script as its own directory would (it imports ``_common`` by name)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


ks = _bench_module("_ks")
audit = _bench_module("timing_audit")

TINY = KVLayout.mla(num_layers=2, kv_lora_rank=32, rope_dim=8, dtype=torch.bfloat16)


# ---- the KS test --------------------------------------------------------------------------------


def test_kolmogorov_tail_matches_known_values() -> None:
    # scipy.stats.kstwobign.sf at 0.5 and 1.0, and the textbook critical values.
    assert ks.kolmogorov_sf(0.5) == pytest.approx(0.9639452436648751, rel=1e-9)
    assert ks.kolmogorov_sf(1.0) == pytest.approx(0.26999967167735456, rel=1e-9)
    assert ks.kolmogorov_sf(1.3581) == pytest.approx(0.05, abs=1e-5)
    assert ks.kolmogorov_sf(1.9495) == pytest.approx(0.001, abs=1e-6)
    assert ks.kolmogorov_sf(0.0) == 1.0


def test_ks_statistic_by_hand() -> None:
    # ECDFs of a and b after each value: 1: 1/4 vs 0; 2: 2/4 vs 1/3; 3 (tie): 3/4 vs 2/3;
    # 5: 3/4 vs 1; 8: 1 vs 1 -> D = max(1/4, 1/6, 1/12, 1/4) = 1/4.
    assert ks.ks_statistic([1.0, 2.0, 3.0, 8.0], [2.0, 3.0, 5.0]) == pytest.approx(0.25)
    assert ks.ks_statistic([1.0, 2.0], [3.0, 4.0]) == 1.0
    same = ks.ks_2samp([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])
    assert (same.d, same.p_value) == (0.0, 1.0)


def test_ks_statistic_matches_its_definition() -> None:
    rng = random.Random(3)
    for _ in range(50):
        a = [rng.choice(range(20)) / 4 for _ in range(rng.randint(1, 30))]
        b = [rng.choice(range(20)) / 4 for _ in range(rng.randint(1, 30))]
        brute = max(
            abs(sum(x <= v for x in a) / len(a) - sum(y <= v for y in b) / len(b)) for v in a + b
        )
        assert ks.ks_statistic(a, b) == pytest.approx(brute)


# ---- the audit's probes -------------------------------------------------------------------------


def test_audit_classifies_probes(tmp_path: Path, index: Index) -> None:
    results = {
        r.spec.name: r
        for r in audit.run_audit(tmp_path / "cache", n=30, tokens=256, layout=TINY, warmup=2)
    }
    assert set(results) == {"cross-tenant", "cross-scope", "same-namespace"}
    # Positive control: the owner's shared probes hit all but the replaced block and load it.
    control = results["same-namespace"]
    assert control.outcomes("shared") == [("hit", 192)] * 30
    assert control.outcomes("fresh") == [("miss", 0)] * 30
    # Across tenants and scopes the very same probes miss.
    for name in ("cross-tenant", "cross-scope"):
        assert results[name].outcomes("shared") == [("miss", 0)] * 30, name
        assert results[name].outcomes("fresh") == [("miss", 0)] * 30, name
    for result in results.values():
        assert result.misclassified() == []
        groups = [a.group for a in result.attempts]
        assert groups != sorted(groups), "the two groups must be interleaved"
        assert all(a.attempt_s >= a.lookup_s > 0 for a in result.attempts)


# ---- the verdicts -------------------------------------------------------------------------------


def _scenario(name: str, control: bool, shared_ms: list[float], fresh_ms: list[float]) -> object:
    spec = next(s for s in audit.SCENARIOS if s.name == name)
    assert spec.positive_control is control
    result = audit.ScenarioResult(spec, 256, 192 if control else 0)
    for group, values in (("shared", shared_ms), ("fresh", fresh_ms)):
        for ms in values:
            outcome = ("hit", 192) if group == "shared" and control else ("miss", 0)
            result.attempts.append(
                audit.Attempt(group, ms / 1e3, ms / 2e3, ms / 2e3, outcome[1], outcome[0])
            )
    return result


SLOW = [float(v) for v in range(100, 200)]
FAST = [float(v) for v in range(0, 100)]
MIXED = [v + 0.5 for v in range(0, 200, 2)]  # interleaves with SLOW + FAST


def test_verdicts_pass_only_when_the_control_distinguishes_and_the_rest_do_not() -> None:
    honest = [
        _scenario("cross-tenant", False, SLOW[::2] + FAST[::2], MIXED),
        _scenario("same-namespace", True, SLOW, FAST),
    ]
    assert all(v.passed for v in audit.judge(honest, 0.001))

    blind_control = [_scenario("same-namespace", True, SLOW[::2] + FAST[::2], MIXED)]
    failed = [v for v in audit.judge(blind_control, 0.001) if not v.passed]
    assert [(v.scenario, v.measure) for v in failed] == [("same-namespace", "attempt")]

    leaking = [_scenario("cross-scope", False, FAST, SLOW)]
    failed = [v for v in audit.judge(leaking, 0.001) if not v.passed]
    assert {v.measure for v in failed} == {"attempt", "lookup", "load"}


def test_a_cross_namespace_hit_is_misclassified() -> None:
    result = _scenario("cross-tenant", False, FAST, SLOW)
    assert result.misclassified() == []
    result.attempts[0] = audit.Attempt("shared", 0.001, 0.0005, 0.0005, 192, "hit")
    assert result.misclassified() == ["shared probe: hit of 192 tokens, expected miss of 0"]
