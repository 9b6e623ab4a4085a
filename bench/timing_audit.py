#!/usr/bin/env python3
"""Timing side-channel audit: can a tenant tell, from latency, that another namespace cached a
prompt? (The attack of Gu et al. 2025, run against tenantkv.)

Gu et al. found API providers sharing prompt caches across customers by timing: the victim sends
a long prompt; the attacker sends prompts sharing most of it and fresh prompts, 250 of each, and
a KS test on the latencies tells a cached prefix from a cold one. Here, for each scenario:

* the victim namespace stores a long random prompt (``--tokens``, default 2,048) with its KV;
* the attacker sends ``--n`` (250) *shared* probes -- the victim's prompt with its last block
  replaced by fresh random tokens, so they share all but one block (97% at 2,048 tokens) -- and
  ``--n`` *fresh* probes (random prompts of the same length), shuffled together so that the
  machine's noise (a shared, busy host) falls on both groups alike, after ``--warmup`` untimed
  probes of each kind;
* each probe is what an attacker sees of one attempt: ``lookup`` of the probe, then ``load`` of
  what the lookup reported (every layer consumed), or, when it reported nothing, an attempt to
  load the probe anyway (a miss: ``CacheMissError``). Lookup, load and the whole attempt are
  timed separately;
* a two-sample KS test (``tenantkv/conformance/ks.py``, which ``tenantkv conformance`` uses
  too) compares shared with fresh probes for each timing.

Scenarios (one cache, the embedded default: SQLite + local directory + key file in a temporary
root):

1. ``cross-tenant``: victim tenant ``victim``, attacker tenant ``attacker`` (same model/layout);
2. ``cross-scope``: victim scope ``s1`` of tenant ``victim``, attacker scope ``s2`` of it;
3. ``same-namespace``: the positive control. The attacker *is* in the victim's namespace, so the
   shared probes hit (and load ~all of the prompt) while the fresh ones miss.

The audit exits non-zero when the positive control fails to distinguish (the audit would then
be blind and its other verdicts vacuous), when any probe is classified against expectation (a
cross-namespace hit is an isolation failure outright), or when a cross-namespace timing's KS
p-value is below ``--alpha`` (default 0.001; see ``docs/perf.md`` for the choice). Output: the
machine, a min / median / max table per scenario and group, the KS statistic D, p-value and
verdict per scenario and timing, ``timing_audit.png`` (ECDFs of both groups per scenario and
timing) and ``timing_audit.json`` (every sample) under ``--out``.

Run:  .venv/bin/python bench/timing_audit.py [--n 250] [--tokens 2048] [--layers 61] [--out DIR]
"""

from __future__ import annotations

import gc
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _cli import bench_parser, write_outputs
from _common import format_stats_table, print_machine
from _fixtures import deepseek_layout, load_all, random_layers, random_tokens
from _ks import KsResult, ks_2samp
from _plots import pyplot, save_figure

import tenantkv
from tenantkv import KVLayout, Namespace, TenantKV
from tenantkv.errors import CacheMissError

MODEL = "deepseek-v3"
GROUPS = ("shared", "fresh")
MEASURES = ("attempt", "lookup", "load")
HIT = "hit"
MISS = "miss"


@dataclass(frozen=True)
class Attempt:
    """One probe as the attacker saw it: its group, timings (s) and what it got back."""

    group: str
    attempt_s: float
    lookup_s: float
    load_s: float
    #: Tokens the lookup reported cached (and the load delivered, for a hit).
    hit_tokens: int
    #: ``hit`` (lookup > 0 and every layer loaded), ``miss`` (lookup 0 and the load refused
    #: with CacheMissError) or a description of anything else (an audit failure).
    outcome: str

    def seconds(self, measure: str) -> float:
        return {"attempt": self.attempt_s, "lookup": self.lookup_s, "load": self.load_s}[measure]


@dataclass(frozen=True)
class ScenarioSpec:
    """Who stores (victim) and who probes (attacker); whether a difference is expected."""

    name: str
    description: str
    victim: tuple[str, str | None]  # tenant, scope
    attacker: tuple[str, str | None]
    positive_control: bool


SCENARIOS = (
    ScenarioSpec(
        "cross-tenant",
        "victim tenant A, attacker tenant B",
        ("victim", None),
        ("attacker", None),
        False,
    ),
    ScenarioSpec(
        "cross-scope",
        "victim scope s1, attacker scope s2 of one tenant",
        ("victim", "s1"),
        ("victim", "s2"),
        False,
    ),
    ScenarioSpec(
        "same-namespace",
        "positive control: attacker in the victim's namespace",
        ("victim", "control"),
        ("victim", "control"),
        True,
    ),
)


@dataclass
class ScenarioResult:
    spec: ScenarioSpec
    prompt_tokens: int
    #: What a shared probe must get back: the victim's prompt minus the replaced last block in
    #: the positive control, nothing across namespaces.
    expected_shared_hit: int
    attempts: list[Attempt] = field(default_factory=list)

    def seconds(self, group: str, measure: str) -> list[float]:
        return [a.seconds(measure) for a in self.attempts if a.group == group]

    def outcomes(self, group: str) -> list[tuple[str, int]]:
        return [(a.outcome, a.hit_tokens) for a in self.attempts if a.group == group]

    def ks(self, measure: str) -> KsResult:
        return ks_2samp(self.seconds("shared", measure), self.seconds("fresh", measure))

    def misclassified(self) -> list[str]:
        """Probes whose outcome is not what the scenario must give (empty when all are)."""
        wrong: list[str] = []
        for attempt in self.attempts:
            if attempt.group == "shared" and self.spec.positive_control:
                expected = (HIT, self.expected_shared_hit)
            else:
                expected = (MISS, 0)
            if (attempt.outcome, attempt.hit_tokens) != expected:
                wrong.append(
                    f"{attempt.group} probe: {attempt.outcome} of {attempt.hit_tokens} tokens, "
                    f"expected {expected[0]} of {expected[1]}"
                )
        return wrong


def make_probes(
    prompt: Sequence[int], block_tokens: int, n: int, rng: random.Random
) -> list[tuple[str, list[int]]]:
    """``n`` shared probes (``prompt`` with its last block replaced, each with its own random
    block) and ``n`` fresh probes of the same length, shuffled together.

    Every probe is made of new int objects, as a request parsed off the network is: shared
    probes that reused one list's objects ran ~5 us faster than fresh ones in the attacker's
    own process with no victim at all (the same objects, hot in the CPU caches, through the
    token conversion), which the audit then took for a leak once a lookup's own spread fell
    below that (docs/perf.md, "Timing side channel audit")."""
    keep = list(prompt[: len(prompt) - block_tokens])
    probes = [
        ("shared", [token + 0 for token in keep] + random_tokens(rng, block_tokens))
        for _ in range(n)
    ]
    probes += [("fresh", random_tokens(rng, len(prompt))) for _ in range(n)]
    rng.shuffle(probes)
    return probes


def probe(ns: Namespace, group: str, tokens: list[int]) -> Attempt:
    """The attacker's whole attempt: look the probe up, then load what the lookup reported (or
    try the probe itself when it reported nothing). The garbage collector is off meanwhile, so
    its pauses do not land inside one group's timings more than the other's."""
    gc.disable()
    try:
        started = time.perf_counter()
        hit = ns.lookup(tokens)
        looked_up = time.perf_counter()
        outcome = MISS
        try:
            full = len(tokens) - len(tokens) % ns.block_tokens
            delivered = load_all(ns, tokens[: hit or full])
            outcome = HIT if delivered == ns.layout.num_layers else f"{delivered} layers"
        except CacheMissError:
            outcome = MISS if hit == 0 else "cache miss after a hit"
        loaded = time.perf_counter()
    finally:
        gc.enable()
    if hit == 0 and outcome == HIT:
        outcome = "load hit after a lookup miss"
    return Attempt(
        group=group,
        attempt_s=loaded - started,
        lookup_s=looked_up - started,
        load_s=loaded - looked_up,
        hit_tokens=hit,
        outcome=outcome,
    )


def run_scenario(
    kv: TenantKV,
    spec: ScenarioSpec,
    layout: KVLayout,
    *,
    tokens: int,
    n: int,
    warmup: int,
    rng: random.Random,
) -> ScenarioResult:
    victim_tenant, victim_scope = spec.victim
    attacker_tenant, attacker_scope = spec.attacker
    victim = kv.namespace(victim_tenant, model=MODEL, layout=layout, scope=victim_scope)
    attacker = kv.namespace(attacker_tenant, model=MODEL, layout=layout, scope=attacker_scope)
    prompt = random_tokens(rng, tokens)
    stored = victim.store(prompt, random_layers(layout, tokens, rng.randrange(2**31)))
    if stored != tokens:
        raise RuntimeError(f"the victim stored {stored} of {tokens} tokens")
    if victim.lookup(prompt) != tokens:
        raise RuntimeError("the victim does not hit its own prompt")
    expected = tokens - victim.block_tokens if spec.positive_control else 0
    result = ScenarioResult(spec, tokens, expected)
    for group, probe_tokens in make_probes(prompt, victim.block_tokens, warmup, rng):
        probe(attacker, group, probe_tokens)  # untimed: warms the code paths and the index
    gc.collect()
    for group, probe_tokens in make_probes(prompt, victim.block_tokens, n, rng):
        result.attempts.append(probe(attacker, group, probe_tokens))
    return result


def run_audit(
    root: Path,
    *,
    n: int = 250,
    tokens: int = 2048,
    layout: KVLayout | None = None,
    warmup: int = 20,
    seed: int = 0,
) -> list[ScenarioResult]:
    """Every scenario on one cache at ``root`` (the embedded default unless the environment
    says otherwise); the core of the audit, without printing or verdicts."""
    layout = layout or deepseek_layout(61)
    rng = random.Random(seed)
    with tenantkv.open(root, durable=False) as kv:
        kv.create_tenant("victim")
        kv.create_tenant("attacker")
        return [
            run_scenario(kv, spec, layout, tokens=tokens, n=n, warmup=warmup, rng=rng)
            for spec in SCENARIOS
        ]


@dataclass(frozen=True)
class Verdict:
    scenario: str
    measure: str
    ks: KsResult
    passed: bool
    text: str


def judge(results: Sequence[ScenarioResult], alpha: float) -> list[Verdict]:
    """KS verdicts: the positive control's whole attempt must differ (p < alpha); no timing of a
    cross-namespace scenario may (p >= alpha). The positive control's lookup and load are
    reported, not judged (they differ by construction)."""
    verdicts: list[Verdict] = []
    for result in results:
        for measure in MEASURES:
            ks = result.ks(measure)
            if result.spec.positive_control:
                if measure != "attempt":
                    verdicts.append(Verdict(result.spec.name, measure, ks, True, "(reported)"))
                elif ks.p_value < alpha:
                    verdicts.append(Verdict(result.spec.name, measure, ks, True, "distinguishes"))
                else:
                    text = "FAIL: the positive control does not distinguish"
                    verdicts.append(Verdict(result.spec.name, measure, ks, False, text))
            elif ks.p_value >= alpha:
                verdicts.append(Verdict(result.spec.name, measure, ks, True, "no difference"))
            else:
                text = f"FAIL: distinguishable (p < {alpha:g})"
                verdicts.append(Verdict(result.spec.name, measure, ks, False, text))
    return verdicts


def format_verdicts(verdicts: Sequence[Verdict]) -> str:
    header = f"{'scenario':<16}  {'timing':<8}  {'n':>9}  {'KS D':>6}  {'p-value':>10}  verdict"
    lines = [header, "-" * len(header)]
    for v in verdicts:
        sizes = f"{v.ks.n}/{v.ks.m}"
        lines.append(
            f"{v.scenario:<16}  {v.measure:<8}  {sizes:>9}  {v.ks.d:>6.3f}  "
            f"{v.ks.p_value:>10.3g}  {v.text}"
        )
    return "\n".join(lines)


def plot(results: Sequence[ScenarioResult], path: Path) -> None:
    """ECDFs of shared vs fresh probes, one panel per scenario (rows) and timing (columns)."""
    fig, axes = pyplot().subplots(
        len(results), len(MEASURES), figsize=(13, 3.2 * len(results)), squeeze=False
    )
    for row, result in enumerate(results):
        for col, measure in enumerate(MEASURES):
            ax = axes[row][col]
            for group, colour in zip(GROUPS, ("#d62728", "#1f77b4"), strict=True):
                ms = sorted(s * 1e3 for s in result.seconds(group, measure))
                ys = [(i + 1) / len(ms) for i in range(len(ms))]
                ax.step(ms, ys, where="post", color=colour, label=f"{group} (n={len(ms)})")
            ks = result.ks(measure)
            ax.set_title(
                f"{result.spec.name}: {measure}  D={ks.d:.3f} p={ks.p_value:.3g}", fontsize=9
            )
            ax.set_xscale("log")
            ax.set_xlabel("ms (log)")
            ax.set_ylabel("ECDF")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("tenantkv timing audit: attacker's shared-prefix vs fresh probes", fontsize=10)
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, layers=61, seed=0)
    parser.add_argument("--n", type=int, default=250, help="probes per group and scenario")
    parser.add_argument("--tokens", type=int, default=2048, help="victim prompt length")
    parser.add_argument("--warmup", type=int, default=20, help="untimed probes per group")
    parser.add_argument("--alpha", type=float, default=0.001, help="KS significance level")
    args = parser.parse_args(argv)
    if args.tokens < 128 or args.tokens % 64:
        parser.error("--tokens must be a multiple of 64, at least 128")
    if args.n < 2 or args.warmup < 0 or not 0 < args.alpha < 1:
        parser.error("--n must be >= 2, --warmup >= 0, 0 < --alpha < 1")
    print_machine(args.dir)
    layout = deepseek_layout(args.layers)
    print(
        f"victim prompt {args.tokens:,} tokens, MLA {args.layers} layers x 576 bf16 "
        f"({args.tokens * args.layers * 1152 / 1e6:.1f} MB of KV); {args.n} shared + {args.n} "
        f"fresh probes per scenario, shuffled, after {args.warmup} + {args.warmup} untimed; "
        f"seed {args.seed}\n"
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        results = run_audit(
            Path(root) / "cache",
            n=args.n,
            tokens=args.tokens,
            layout=layout,
            warmup=args.warmup,
            seed=args.seed,
        )
    failures: list[str] = []
    for result in results:
        print(f"{result.spec.name}: {result.spec.description}")
        rows = [
            (f"{group}: {measure}", [s * 1e3 for s in result.seconds(group, measure)], "")
            for measure in MEASURES
            for group in GROUPS
        ]
        print(format_stats_table(rows, "ms", label="probes (timing)", digits=3))
        for group in GROUPS:
            counts: dict[str, int] = {}
            for outcome, hit in result.outcomes(group):
                key = f"{outcome} {hit}" if outcome == HIT else outcome
                counts[key] = counts.get(key, 0) + 1
            shown = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
            print(f"  {group} probes (n={len(result.outcomes(group))}): {shown}")
        wrong = result.misclassified()
        if wrong:
            failures.append(f"{result.spec.name}: {len(wrong)} probes misclassified: {wrong[0]}")
        print()
    verdicts = judge(results, args.alpha)
    print(f"two-sample KS, shared vs fresh, two-sided asymptotic p; alpha = {args.alpha:g}")
    print(format_verdicts(verdicts))
    failures += [f"{v.scenario} {v.measure}: {v.text}" for v in verdicts if not v.passed]
    samples = {
        r.spec.name: {
            "expected_shared_hit": r.expected_shared_hit,
            "attempts": [a.__dict__ for a in r.attempts],
        }
        for r in results
    }
    write_outputs(args.out, "timing_audit", samples, lambda png: plot(results, png), indent=1)
    print(f"took {time.perf_counter() - started:.0f} s")
    if failures:
        print("\nAUDIT FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\naudit passed: the positive control distinguishes, cross-namespace probes do not")
    return 0


if __name__ == "__main__":
    sys.exit(main())
