"""The timing side-channel audit (``bench/timing_audit.py``) and its KS test (``bench/_ks.py``).

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

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench_module(name: str) -> ModuleType:
    """Import a bench script as its own directory would (it imports ``_common`` by name)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


ks = _bench_module("_ks")

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
