"""The conformance report: one verdict per case, the rule that pairs each "other identity ->
miss" probe with its "same identity -> hit" control, the table and the JSON.

Why a verdict of its own for a failed control: a miss proves isolation only where the same
request from the owner does hit. When the owner's repeat misses (the cache is off, the prompt
too short, the backend restarted), the probe's miss says nothing, so the case is INCONCLUSIVE,
and an inconclusive case fails the run like a leak does: the command never reports a pass it
could not observe. SKIPPED is for what was not asked for or cannot be reached from the
arguments given (no second model, no backend URL to empty vLLM's cache); each says why.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


class Outcome(enum.Enum):
    """A case's verdict; every one but PASS and SKIPPED fails the run."""

    PASS = "pass"
    FAIL = "FAIL"
    INCONCLUSIVE = "INCONCLUSIVE"
    SKIPPED = "skipped"

    @property
    def fails_the_run(self) -> bool:
        return self in (Outcome.FAIL, Outcome.INCONCLUSIVE)


def judge(probe_hit: bool | None, control_hit: bool | None, potent: bool | None = True) -> Outcome:
    """The verdict of one isolation case.

    ``probe_hit``: whether the other identity's request (or the attack) was served from the
    owner's cache; ``control_hit``: whether the owner's same request was; ``potent``: for an
    attack, whether its material does read the owner's cache when it reaches the engine
    directly (None: not checked; False makes the miss meaningless). None for a hit means it
    could not be read."""
    if probe_hit:
        return Outcome.FAIL  # a leak is a failure whatever the control says
    if probe_hit is None or not control_hit or potent is False:
        return Outcome.INCONCLUSIVE
    return Outcome.PASS


@dataclass(frozen=True)
class CaseResult:
    """One row of the matrix (or one attack): what was probed, where, and what was seen."""

    name: str
    dimension: str  # tenant / scope / model, or attack:<kind>
    entrypoint: str  # completions / chat
    stream: bool
    tier: str  # vllm (its prefix cache, via the salt) / tenantkv (the connector)
    outcome: Outcome
    detail: str = ""
    probe_cached: int | None = None
    control_cached: int | None = None
    hits_from: str = "usage"  # usage (cached_tokens) / timing

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["outcome"] = self.outcome.value
        return data


@dataclass(frozen=True)
class TimingResult:
    """The KS timing audit on time to first token: cross-tenant (another tenant's probes of
    the owner's prefixes against its fresh prompts) must not separate (p > ``cross_alpha``);
    the same-tenant control (the owner's repeats against its fresh prompts) must (p <
    ``control_alpha``), else the audit could not have seen a leak and is inconclusive."""

    outcome: Outcome
    samples: int
    cross_d: float | None = None
    cross_p: float | None = None
    control_d: float | None = None
    control_p: float | None = None
    cross_alpha: float = 1e-3
    control_alpha: float = 1e-6
    medians_ms: dict[str, float] = field(default_factory=dict)
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["outcome"] = self.outcome.value
        return data


def timing_outcome(
    cross_p: float, control_p: float, *, cross_alpha: float = 1e-3, control_alpha: float = 1e-6
) -> Outcome:
    """FAIL when another tenant's timings tell the owner's prefixes apart; INCONCLUSIVE when
    the owner's own hits cannot be told apart (the audit had no power); else PASS."""
    if cross_p <= cross_alpha:
        return Outcome.FAIL
    if control_p >= control_alpha:
        return Outcome.INCONCLUSIVE
    return Outcome.PASS


@dataclass
class Report:
    """Everything one run found, with what it was run against."""

    target: dict[str, Any]
    cases: list[CaseResult] = field(default_factory=list)
    timing: TimingResult | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        outcomes = [case.outcome for case in self.cases]
        if self.timing is not None:
            outcomes.append(self.timing.outcome)
        return any(outcome.fails_the_run for outcome in outcomes)

    def counts(self) -> dict[str, int]:
        outcomes = [case.outcome for case in self.cases]
        if self.timing is not None:
            outcomes.append(self.timing.outcome)
        return {o.value: sum(1 for x in outcomes if x is o) for o in Outcome}

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "passed": not self.failed,
            "counts": self.counts(),
            "cases": [case.to_json() for case in self.cases],
            "timing": None if self.timing is None else self.timing.to_json(),
            "notes": list(self.notes),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False)

    def table(self) -> str:
        """The report as text: one line per case, the timing audit, the notes, the verdict."""
        header = ("case", "dimension", "entrypoint", "tier", "probe", "control", "outcome")
        rows = [
            (
                case.name,
                case.dimension,
                case.entrypoint + (" (stream)" if case.stream else ""),
                case.tier,
                _cached(case.probe_cached, case.hits_from),
                _cached(case.control_cached, case.hits_from),
                case.outcome.value + (f": {case.detail}" if case.detail else ""),
            )
            for case in self.cases
        ]
        lines = _columns([header, *rows])
        if self.timing is not None:
            t = self.timing
            lines.append("")
            lines.append(
                f"timing audit (KS on time to first token, {t.samples} per group): "
                f"cross-tenant p={_p(t.cross_p)} (must be > {t.cross_alpha:g}), "
                f"same-tenant control p={_p(t.control_p)} (must be < {t.control_alpha:g}): "
                + t.outcome.value
                + (f": {t.detail}" if t.detail else "")
            )
        lines.extend(f"note: {note}" for note in self.notes)
        counts = ", ".join(f"{n} {name}" for name, n in self.counts().items() if n)
        lines.append(f"{'FAILED' if self.failed else 'PASSED'} ({counts})")
        return "\n".join(lines)


def _cached(value: int | None, hits_from: str) -> str:
    if value is None:
        return "-"
    return f"{value} cached" if hits_from == "usage" else ("hit" if value else "miss") + " (t)"


def _p(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True))
        + "  "
        + row[-1]
        for row in rows
    ]
