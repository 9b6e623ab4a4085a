"""The conformance suite: the isolation matrix, the attacks and the timing audit, run against
a live deployment through its gateway (docs/gateway.md, "Proving isolation").

The matrix is identity dimension (tenant, scope, model) x entrypoint (completions, chat
completions; streamed or not) x tier:

* ``vllm``: vLLM's own prefix cache, which only the gateway's ``cache_salt`` partitions. The
  owner sends a prompt, the other identity sends it, the owner sends it again (the control).
* ``tenantkv``: the connector's tiers, partitioned by the namespace the signed assertion picks.
  The same three requests with vLLM's cache emptied (``POST /reset_prefix_cache`` on every
  backend) before the probe and before the control, so that a cached token can only have come
  from tenantkv. Without backend URLs that cannot be done, and the cases say so (SKIPPED, "not
  separated") rather than pass on hits of the other tier.

Then the attacks, each with the owner's control: a ``cache_salt`` chosen by both clients, the
owner's real salt sent by the other tenant, and ``kv_transfer_params`` carrying a replayed, a
forged and an other-audience assertion (the last three need what only the operator holds, the
deployment's configuration: :class:`AttackMaterial`). Where a backend URL is given, the attacks
that would work if the gateway let them through are first shown to work when sent to the
engine directly (their potency); an attack that is not potent proves nothing (INCONCLUSIVE).

Last, the timing audit (:mod:`ks`): another tenant's time to first token on the owner's
prefixes against its own fresh prompts (must not separate), and the owner's repeats against
its fresh prompts (must separate: the audit's power). Requests are interleaved round by round
so that load drifts hit all groups alike, and the two cross groups follow the same kinds of
request equally often (:func:`timing_round`: a miss's background store slows what comes next).

Every prompt starts with a random run tag, so two runs (or a run and other traffic) share no
block.
"""

from __future__ import annotations

import os
import secrets
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from .ks import ks_2samp
from .probe import ENTRYPOINTS, Observation, Prober
from .report import CaseResult, Outcome, Report, TimingResult, judge, timing_outcome

TIERS: Final = ("vllm", "tenantkv")
DIMENSIONS: Final = ("tenant", "scope", "model")
ASSERTION_ATTACKS: Final = ("replayed", "forged", "other-audience")
_FILLER: Final = (
    "The quarterly report covers revenue, churn, support tickets and the roadmap; "
    "summarise each section in one sentence and list the open risks. "
)


@dataclass(frozen=True)
class Target:
    """The deployment: its gateway, the model, and inference keys of the owner (tenant A,
    one scope), another tenant (B) and another scope of tenant A; optionally a second model
    the gateway serves and the backends' URLs (for ``POST /reset_prefix_cache``)."""

    gateway: str
    model: str
    owner_key: str
    other_tenant_key: str
    other_scope_key: str
    other_model: str | None = None
    backends: tuple[str, ...] = ()


@dataclass(frozen=True)
class AttackMaterial:
    """What an attacker could only have captured, made by the operator from the deployment's
    configuration: the owner's real ``cache_salt`` and assertions for the owner's identity
    (``replayed``: the gateway's own, as if captured; ``forged``: signed by another key;
    ``other-audience``: the gateway's key, another deployment), under ``assertion_param``."""

    owner_salt: str | None = None
    assertions: dict[str, str] = field(default_factory=dict)
    assertion_param: str = "tenantkv_assertion"


@dataclass(frozen=True)
class Plan:
    """How much to run: ``samples`` per group of the timing audit (0: no audit), prompt
    lengths in characters, which entrypoints and streaming modes, whether the attacks."""

    samples: int = 20
    prompt_chars: int = 400
    timing_chars: int = 1500
    entrypoints: tuple[str, ...] = ENTRYPOINTS
    streams: tuple[bool, ...] = (False, True)
    attacks: bool = True


def prompt(run: str, tag: str, chars: int) -> str:
    """A prompt of about ``chars`` characters that starts with the run's and the case's tags
    (so its first block is its own)."""
    head = f"[{run} {tag}] "
    body = _FILLER * (max(0, chars - len(head)) // len(_FILLER) + 1)
    return head + body[: max(0, chars - len(head))]


def timing_round(i: int) -> list[tuple[str, str]]:
    """Round ``i`` of the timing audit: (group, prompt tag) in the order they are sent.

    The owner's fresh miss comes first and stores the prompt; then the other tenant's request
    for it and for a fresh prompt, those two swapped every round; then the owner's repeat.
    A miss leaves work behind it (its store, in the background) that slows the request after
    it, so the two cross groups must follow the same kinds of request equally often: here each
    follows the owner's miss in half the rounds and the other cross request in the rest, and
    holds each position as often. (Reversing all three every other round put ``cross_fresh``
    after the owner's fast hit in half the rounds and ``cross_stored`` never: on vLLM's CPU
    backend, KS p = 0.0006 and 0.0013 at 60 per group between groups that shared no cache.)
    """
    cross = [("cross_stored", f"stored-{i}"), ("cross_fresh", f"fresh-{i}")]
    if i % 2:
        cross.reverse()
    return [("same_fresh", f"stored-{i}"), *cross, ("same_hit", f"stored-{i}")]


class HitReader:
    """Reads whether an answer was served from a cache: from ``cached_tokens`` where vLLM
    reports it, else from its time to first token against a threshold the timing audit
    calibrated (None until then: a hit that cannot be read)."""

    def __init__(self) -> None:
        self.threshold: float | None = None

    def hit(self, seen: Observation) -> bool | None:
        if seen.cached is not None:
            return seen.cached > 0
        if self.threshold is None:
            return None
        return seen.ttft < self.threshold

    def source(self, seen: Observation) -> str:
        return "usage" if seen.cached is not None else "timing"


class Suite:
    """One run of the suite against ``target``."""

    def __init__(
        self,
        prober: Prober,
        target: Target,
        plan: Plan,
        material: AttackMaterial | None = None,
        *,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.prober = prober
        self.target = target
        self.plan = plan
        self.material = material or AttackMaterial()
        self.run_tag = secrets.token_hex(4)
        self.reader = HitReader()
        self.progress = progress or (lambda _: None)

    # ------------------------------------------------------------------ plumbing

    def _send(
        self,
        key: str | None,
        text: str,
        *,
        entrypoint: str = "completions",
        stream: bool = False,
        model: str | None = None,
        base_url: str | None = None,
        **extra: object,
    ) -> Observation:
        return self.prober.send(
            base_url or self.target.gateway,
            key,
            entrypoint,
            model or self.target.model,
            text,
            stream=stream,
            **extra,
        )

    def _reset(self) -> None:
        for backend in self.target.backends:
            self.prober.reset_prefix_cache(backend)

    def _text(self, tag: str) -> str:
        return prompt(self.run_tag, tag, self.plan.prompt_chars)

    def _case(
        self,
        name: str,
        dimension: str,
        entrypoint: str,
        stream: bool,
        tier: str,
        store: Observation,
        probe: Observation,
        control: Observation,
        *,
        potent: bool | None = True,
        detail: str = "",
    ) -> CaseResult:
        stored_hit = self.reader.hit(store)
        outcome = judge(self.reader.hit(probe), self.reader.hit(control), potent)
        if stored_hit and outcome is Outcome.PASS:
            outcome, detail = Outcome.INCONCLUSIVE, "the fresh prompt was already cached"
        elif outcome is Outcome.FAIL:
            detail = "the other identity was served the owner's cache"
        elif outcome is Outcome.INCONCLUSIVE and not detail:
            detail = (
                "the attack does not work even sent to the engine directly"
                if potent is False and self.reader.hit(control)
                else "the owner's control did not hit, so the miss proves nothing"
            )
        return CaseResult(
            name=name,
            dimension=dimension,
            entrypoint=entrypoint,
            stream=stream,
            tier=tier,
            outcome=outcome,
            detail=detail,
            probe_cached=_shown(probe, self.reader),
            control_cached=_shown(control, self.reader),
            hits_from=self.reader.source(probe),
        )

    # ------------------------------------------------------------------ the parts

    def run(self) -> Report:
        report = Report(target=self._described())
        if not self.target.backends:
            report.notes.append(
                "no --backend given: the tenantkv tier was not separated from vLLM's prefix "
                "cache (its cases are SKIPPED); give each vllm serve URL, run with "
                "VLLM_SERVER_DEV_MODE=1, for POST /reset_prefix_cache"
            )
        if self.plan.samples > 0:
            report.timing = self.timing_audit()
            if self.reader.threshold is None:
                report.notes.append("hits cannot be read from timing: the control did not separate")
        else:
            report.notes.append("timing audit not run (--samples 0)")
        report.cases.extend(self.matrix())
        report.cases.extend(self.attacks())
        if not self.plan.attacks:
            report.notes.append("attacks not run (--no-attacks)")
        return report

    def _described(self) -> dict[str, object]:
        t = self.target
        return {
            "gateway": t.gateway,
            "model": t.model,
            "other_model": t.other_model,
            "backends": list(t.backends),
            "samples": self.plan.samples,
            "run_tag": self.run_tag,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        }

    def _other(self, dimension: str) -> tuple[str, str | None] | None:
        """The other identity of ``dimension``: its key and model; None if not given."""
        t = self.target
        if dimension == "tenant":
            return t.other_tenant_key, None
        if dimension == "scope":
            return t.other_scope_key, None
        return (t.owner_key, t.other_model) if t.other_model else None

    def matrix(self) -> list[CaseResult]:
        cases = []
        for dimension in DIMENSIONS:
            other = self._other(dimension)
            for entrypoint in self.plan.entrypoints:
                for stream in self.plan.streams:
                    for tier in TIERS:
                        name = f"{dimension}/{entrypoint}/{'stream' if stream else 'json'}/{tier}"
                        self.progress(name)
                        if other is None:
                            cases.append(
                                _skipped(
                                    name, dimension, entrypoint, stream, tier, "no --other-model"
                                )
                            )
                        elif tier == "tenantkv" and not self.target.backends:
                            cases.append(
                                _skipped(name, dimension, entrypoint, stream, tier, _NOT_SEPARATED)
                            )
                        else:
                            cases.append(
                                self._isolation_case(
                                    name, dimension, entrypoint, stream, tier, other
                                )
                            )
        return cases

    def _isolation_case(
        self,
        name: str,
        dimension: str,
        entrypoint: str,
        stream: bool,
        tier: str,
        other: tuple[str, str | None],
    ) -> CaseResult:
        owner, (other_key, other_model) = self.target.owner_key, other
        text = self._text(name)
        store = self._send(owner, text, entrypoint=entrypoint, stream=stream)
        if tier == "tenantkv":
            self._reset()  # from here only tenantkv can serve the owner's prefix
        probe = self._send(other_key, text, entrypoint=entrypoint, stream=stream, model=other_model)
        if tier == "tenantkv":
            self._reset()  # the control's hit, too, can only be tenantkv's
        control = self._send(owner, text, entrypoint=entrypoint, stream=stream)
        return self._case(name, dimension, entrypoint, stream, tier, store, probe, control)

    def attacks(self) -> list[CaseResult]:
        """Client-chosen identity fields, each with the owner's control (completions, JSON)."""
        if not self.plan.attacks:
            return []
        cases = [self._chosen_salt()]
        cases.append(self._owner_salt())
        for kind in ASSERTION_ATTACKS:
            cases.append(self._assertion(kind))
        return cases

    def _chosen_salt(self) -> CaseResult:
        # Both clients send the same salt: a gateway that let client salts through would put
        # them in one partition of vLLM's cache.
        name = "attack/chosen-cache_salt"
        self.progress(name)
        salt = f"conformance-{self.run_tag}"
        text = self._text(name)
        t = self.target
        store = self._send(t.owner_key, text, cache_salt=salt)
        probe = self._send(t.other_tenant_key, text, cache_salt=salt)
        control = self._send(t.owner_key, text, cache_salt=salt)
        return self._case(
            name, "attack:cache_salt", "completions", False, "vllm", store, probe, control
        )

    def _owner_salt(self) -> CaseResult:
        name = "attack/owner's-cache_salt"
        self.progress(name)
        salt = self.material.owner_salt
        if salt is None:
            return _skipped(name, "attack:cache_salt", "completions", False, "vllm", _NEEDS_CONFIG)
        text = self._text(name)
        t = self.target
        store = self._send(t.owner_key, text)
        probe = self._send(t.other_tenant_key, text, cache_salt=salt)
        control = self._send(t.owner_key, text)
        potent: bool | None = None
        if t.backends:  # the salt, sent straight to vLLM, does read the owner's blocks
            potent = any(
                self.reader.hit(self._send(None, text, base_url=b, cache_salt=salt))
                for b in t.backends
            )
        return self._case(
            name, "attack:cache_salt", "completions", False, "vllm", store, probe, control,
            potent=potent,
        )  # fmt: skip

    def _assertion(self, kind: str) -> CaseResult:
        name = f"attack/{kind}-assertion"
        self.progress(name)
        dimension = "attack:kv_transfer_params"
        token = self.material.assertions.get(kind)
        if token is None:
            return _skipped(name, dimension, "completions", False, "tenantkv", _NEEDS_CONFIG)
        if not self.target.backends:
            return _skipped(name, dimension, "completions", False, "tenantkv", _NOT_SEPARATED)
        params = {self.material.assertion_param: token}
        text = self._text(name)
        t = self.target
        store = self._send(t.owner_key, text)
        self._reset()
        probe = self._send(t.other_tenant_key, text, kv_transfer_params=params)
        self._reset()
        control = self._send(t.owner_key, text)
        potent: bool | None = None
        if kind == "replayed":  # a live assertion of the owner's does load its KV if it arrives
            self._reset()
            salt = f"conformance-{self.run_tag}-{kind}"  # no identity's: vLLM's cache is cold
            potent = any(
                self.reader.hit(
                    self._send(None, text, base_url=b, cache_salt=salt, kv_transfer_params=params)
                )
                for b in t.backends
            )
        return self._case(
            name, dimension, "completions", False, "tenantkv", store, probe, control, potent=potent
        )

    def timing_audit(self) -> TimingResult:
        """KS on time to first token (streamed completions, vLLM's tier); see the module doc."""
        n, t = self.plan.samples, self.target
        self.progress(f"timing audit ({n} per group)")

        def text(tag: str) -> str:
            return prompt(self.run_tag, tag, self.plan.timing_chars)

        def ttft(key: str, tag: str) -> float:
            return self._send(key, text(tag), stream=True).ttft

        for i in range(2):  # warm both identities' paths up; not measured
            ttft(t.owner_key, f"warm-a{i}")
            ttft(t.other_tenant_key, f"warm-b{i}")
        groups: dict[str, list[float]] = {
            "same_fresh": [],
            "cross_stored": [],
            "cross_fresh": [],
            "same_hit": [],
        }
        for i in range(n):
            for group, tag in timing_round(i):
                key = t.owner_key if group.startswith("same_") else t.other_tenant_key
                groups[group].append(ttft(key, tag))
        cross = ks_2samp(groups["cross_stored"], groups["cross_fresh"])
        control = ks_2samp(groups["same_hit"], groups["same_fresh"])
        outcome = timing_outcome(cross.p_value, control.p_value)
        medians = {name: statistics.median(values) * 1e3 for name, values in groups.items()}
        if control.p_value < 1e-6:
            # hits read from timing where usage does not say: halfway between the medians
            self.reader.threshold = (medians["same_hit"] + medians["same_fresh"]) / 2e3
        detail = {
            Outcome.FAIL: "another tenant's timings tell the owner's prefixes apart",
            Outcome.INCONCLUSIVE: "the owner's own hits are not told apart: no power to see a leak",
        }.get(outcome, "")
        return TimingResult(
            outcome=outcome,
            samples=n,
            cross_d=cross.d,
            cross_p=cross.p_value,
            control_d=control.d,
            control_p=control.p_value,
            medians_ms=medians,
            detail=detail,
        )


_NOT_SEPARATED: Final = "tier not separated: no --backend to empty vLLM's prefix cache"
_NEEDS_CONFIG: Final = "needs the deployment's configuration (--config) to make the attack"


def _skipped(
    name: str, dimension: str, entrypoint: str, stream: bool, tier: str, why: str
) -> CaseResult:
    return CaseResult(name, dimension, entrypoint, stream, tier, Outcome.SKIPPED, why)


def _shown(seen: Observation, reader: HitReader) -> int | None:
    """What the table shows of an answer: its cached tokens, else 1/0 for a timed hit/miss."""
    if seen.cached is not None:
        return seen.cached
    hit = reader.hit(seen)
    return None if hit is None else int(hit)
