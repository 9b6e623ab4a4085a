"""Engine-side refusals and errors cannot hurt the engine (issue 32): a flood of requests without
a valid tenant assertion is counted and audited per time window by a thread of the cache's own,
not one record each on the engine's thread; an error of the cache on an engine's path is a miss
plus a counted event. Engine-free (``EngineNamespaces`` is the rule both engines call), so it
runs in the main suite; tests_engines/ drives the same paths through vLLM and SGLang."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import tenantkv
from tenantkv.components.incidents import REFUSAL_WINDOW_SECONDS
from tenantkv.components.refusal_windows import OTHER, RefusalWindow, RefusalWindows
from tenantkv.integrations.engine_identity import (
    ASSERTION_PARAM,
    ASSERTION_REFUSED,
    ENGINE_ERRORS,
    EngineNamespaces,
    RequestTenant,
)
from tenantkv.tenant_assertion import AssertionSigner, AssertionVerifier
from tests.helpers import MHA_SMALL, ManualClock, random_layers, random_tokens

NOW = 1_800_000_000.0  # the start of a refusal window (a multiple of 60)
REFUSED = 500


def _engine(kv: tenantkv.TenantKV, verifier: AssertionVerifier) -> EngineNamespaces:
    return EngineNamespaces(kv, verifier, model="tiny", layout=MHA_SMALL, block_tokens=32)


def refusal_records(kv: tenantkv.TenantKV) -> list[dict[str, Any]]:
    """The system chain's ``access.refused`` records of refused engine requests."""
    records = [json.loads(line) for line in kv.audit.export(tenant=None)]
    return [
        r
        for r in records
        if r.get("action") == "access.refused" and r.get("target") == ASSERTION_REFUSED
    ]


class IndexWrites:
    """The threads that opened write transactions on the cache's (real) index, in order: the
    index's own ``write`` and ``write_connection``, wrapped to note the thread first."""

    def __init__(self, kv: tenantkv.TenantKV) -> None:
        self.threads: list[int] = []
        index = kv.context.index
        for name in ("write", "write_connection"):
            setattr(index, name, self._noting(getattr(index, name)))

    def _noting(
        self, open_transaction: Callable[[], AbstractContextManager[Any]]
    ) -> Callable[[], AbstractContextManager[Any]]:
        @contextmanager
        def noted() -> Iterator[Any]:
            self.threads.append(threading.get_ident())
            with open_transaction() as transaction:
                yield transaction

        return noted


def wait_for(condition: Callable[[], bool], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_refused_requests_are_counted_and_audited_per_window_off_the_engines_thread(
    tmp_path: Path, index: object, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock(NOW)
    signer = AssertionSigner(Ed25519PrivateKey.generate(), clock=clock)
    rogue = AssertionSigner(Ed25519PrivateKey.generate(), clock=clock)
    verifier = AssertionVerifier([signer.public_key], clock=clock)
    tokens = random_tokens(96)
    root = tmp_path / "cache"
    caplog.set_level(logging.WARNING, logger="tenantkv.security")
    kv = tenantkv.open(root, durable=False, clock=clock)
    try:
        kv.create_tenant("acme")
        engine = _engine(kv, verifier)
        found = engine.resolve({ASSERTION_PARAM: signer.sign("acme")}, request_id="owner")
        assert found is not None and found[1].store(tokens, random_layers(MHA_SMALL, 96)) == 96
        writes = IndexWrites(kv)
        refused = [None, "tkva1.junk", rogue.sign("acme")]  # missing, malformed, unknown_key
        caller = threading.get_ident()
        for n in range(REFUSED):
            if n == 300:  # the first window ends; the next refusal begins another
                clock.advance(REFUSAL_WINDOW_SECONDS)
            params = {ASSERTION_PARAM: refused[n % 3], "cache_salt": "acme"}
            assert engine.resolve(params, request_id=f"r{n}") is None
        # the engine's thread opened no write transaction: no audit record, no index lock
        assert caller not in writes.threads
        # every refusal is counted at once (the security events and their metric) ...
        assert kv.security_events()[ASSERTION_REFUSED] == REFUSED
        registry = kv.metrics_registry
        if registry is not None:
            from prometheus_client import generate_latest

            text = generate_latest(registry).decode()
            assert f'tenantkv_security_events_total{{kind="{ASSERTION_REFUSED}"}} {REFUSED}.0' in (
                text
            )
        # ... the ended window is audited by the cache's own thread, as one record ...
        wait_for(lambda: len(refusal_records(kv)) == 1)
        assert writes.threads and caller not in writes.threads
        # ... and the log line is rate-limited: not one WARNING line per refused request
        lines = [r for r in caplog.records if ASSERTION_REFUSED in r.getMessage()]
        assert 1 <= len(lines) <= 2
        # positive control: a request with a valid assertion gets its hit
        owner = engine.resolve({ASSERTION_PARAM: signer.sign("acme")}, request_id="owner-2")
        assert owner is not None and (owner[0].tenant, owner[0].scope) == ("acme", None)
        assert owner[1].cached_length(tokens) == 96
    finally:
        kv.close()  # writes the window still open: closing loses no refusal
    with tenantkv.open(root, durable=False, clock=clock) as reopened:
        records = refusal_records(reopened)
    assert len(records) == 2  # one per window, however many refusals each saw
    assert sum(r["details"]["count"] for r in records) == REFUSED  # nothing lost
    totals: dict[str, int] = {}
    for record in records:
        assert record["tenant"] is None and record["outcome"] == "denied"
        assert record["details"]["window_seconds"] == REFUSAL_WINDOW_SECONDS
        for reason, count in record["details"]["reasons"].items():
            totals[reason] = totals.get(reason, 0) + count
    assert totals == {"missing": 167, "malformed": 167, "unknown_key": 166}
    assert [r["details"]["window_start"] for r in records] == [NOW, NOW + REFUSAL_WINDOW_SECONDS]
    # the requests' ids (chosen by the engine or its clients) are kept nowhere in the records
    assert "r499" not in json.dumps(records)


def test_refusal_windows_bound_their_keys_and_count_every_refusal() -> None:
    clock = ManualClock(NOW)
    written: list[list[Any]] = []

    def records(window: RefusalWindow) -> list[Any]:
        return [
            {"key": key, "count": entry.count, "notes": sorted(entry.notes)}
            for key, entry in sorted(window.keys.items())
        ]

    windows = RefusalWindows(
        lambda batch: written.append(list(batch)),
        records,
        window_seconds=60,
        max_keys=3,
        clock=clock,
        what="test refusals",
        max_notes=2,
    )
    news = [windows.count(f"k{n % 10}", "r", note=f"n{n}") for n in range(100)]
    assert news[0] and not any(news[1:])  # only the refusal that began the window is news
    windows.flush_due()
    assert written == []  # the window has not ended
    clock.advance(60)
    assert windows.count("k0", "r")  # a window ended: news for the writer
    windows.flush()
    first, second = written
    assert [r["key"] for r in first] == ["k0", "k1", "k2", OTHER]
    assert sum(r["count"] for r in first) == 100 and first[-1]["count"] == 70
    assert all(len(r["notes"]) == 2 for r in first)
    assert second == [{"key": "k0", "count": 1, "notes": []}]
    stats = windows.stats()
    assert (stats.refused, stats.folded, stats.records) == ({"r": 101}, 70, 5)


def test_a_failed_refusal_write_is_counted_not_raised() -> None:
    clock = ManualClock(NOW)
    failures: list[int] = []

    def write(_batch: object) -> None:
        raise OSError("disk full")

    windows = RefusalWindows(
        write,
        lambda window: [],
        window_seconds=60,
        max_keys=3,
        clock=clock,
        what="test refusals",
        on_flush_error=lambda: failures.append(1),
    )
    windows.count("k", "r")
    windows.flush()  # does not raise
    assert windows.stats().flush_errors == 1 and failures == [1]


def test_a_cache_error_on_the_engines_path_is_a_counted_miss(tmp_path: Path, index: object) -> None:
    clock = ManualClock(NOW)
    signer = AssertionSigner(Ed25519PrivateKey.generate(), clock=clock)
    verifier = AssertionVerifier([signer.public_key], clock=clock)
    kv = tenantkv.open(tmp_path / "cache", durable=False, clock=clock)
    kv.create_tenant("acme")
    engine = _engine(kv, verifier)
    owner = RequestTenant("acme", None)
    assert engine.namespace(owner) is not None  # positive control: the open cache serves it
    kv.close()
    # the cache closed under the engine (its worker side opens namespaces per load): a miss
    # plus a counted event, not a CacheClosedError into the engine's forward pass
    fresh = RequestTenant("acme", "u1")
    assert engine.namespace(fresh) is None
    assert kv.context.health.counts()[ENGINE_ERRORS] == 1
