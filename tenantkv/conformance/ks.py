"""The two-sample Kolmogorov-Smirnov test, in plain Python, for the timing audits
(``tenantkv conformance`` and ``bench/timing_audit.py``).

scipy is not a dependency of tenantkv, and the audit needs only the statistic and its
asymptotic p-value, so they are written out here rather than pulled in with a large package.

* ``D`` is the largest vertical distance between the two empirical CDFs, each evaluated after
  all samples equal to a value (so ties are handled the way scipy's ``ks_2samp`` does).
* The two-sided p-value is the limiting Kolmogorov distribution at ``sqrt(n m / (n + m)) * D``,
  i.e. ``scipy.stats.kstwobign.sf(sqrt(en) * D)`` (scipy's ``method="asymp"`` before 1.5). It
  is accurate at the audit's sizes (hundreds per group); for a handful of samples it is only a
  rough guide.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Below this argument the alternating series converges slowly; use the theta-function form.
_SERIES_SWITCH = 1.18


@dataclass(frozen=True)
class KsResult:
    """A two-sample KS test: statistic ``d``, two-sided asymptotic ``p_value``, group sizes."""

    d: float
    p_value: float
    n: int
    m: int


def ks_statistic(a: Sequence[float], b: Sequence[float]) -> float:
    """sup_x |F_a(x) - F_b(x)| over the empirical CDFs of ``a`` and ``b`` (both non-empty)."""
    if not a or not b:
        raise ValueError("both samples must be non-empty")
    xs, ys = sorted(a), sorted(b)
    n, m = len(xs), len(ys)
    i = j = 0
    d = 0.0
    while i < n and j < m:
        value = min(xs[i], ys[j])
        while i < n and xs[i] <= value:
            i += 1
        while j < m and ys[j] <= value:
            j += 1
        d = max(d, abs(i / n - j / m))
    # Once one sample is used up its CDF is 1 and the other's only rises towards 1: the
    # distance only shrinks, so the maximum has been seen.
    return d


def kolmogorov_sf(x: float) -> float:
    """P(K > x) for the Kolmogorov distribution (the limit of sqrt(n) * D_n)."""
    if x <= 0.0:
        return 1.0
    if x < _SERIES_SWITCH:
        # K(x) = sqrt(2 pi) / x * sum_{j>=1} exp(-(2j - 1)^2 pi^2 / (8 x^2))
        factor = -(math.pi**2) / (8.0 * x * x)
        cdf = sum(math.exp(factor * (2 * j - 1) ** 2) for j in range(1, 12))
        return max(0.0, min(1.0, 1.0 - math.sqrt(2.0 * math.pi) / x * cdf))
    # 1 - K(x) = 2 sum_{j>=1} (-1)^(j-1) exp(-2 j^2 x^2)
    total = 0.0
    for j in range(1, 101):
        term = math.exp(-2.0 * j * j * x * x)
        total += term if j % 2 else -term
        if term < 1e-300:
            break
    return max(0.0, min(1.0, 2.0 * total))


def ks_2samp(a: Sequence[float], b: Sequence[float]) -> KsResult:
    """Two-sided two-sample KS test of ``a`` against ``b`` (asymptotic p-value)."""
    d = ks_statistic(a, b)
    n, m = len(a), len(b)
    return KsResult(d=d, p_value=kolmogorov_sf(math.sqrt(n * m / (n + m)) * d), n=n, m=m)
