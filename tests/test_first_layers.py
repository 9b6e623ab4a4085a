"""Bookkeeping keeps out of the way of loads before their first layer
(tenantkv.datapath.first_layers).

A load's record of use (an index write) runs in the background once no load of the cache is
before its first layer, and at most ``BOOKKEEPING_HOLD_S`` after it was handed over. Every
check that the record is held back has its positive control: the record does land once the
waiting load has its first layer, or once the bound has passed.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest

import tenantkv.datapath.runtime
from tenantkv import CacheMissError, InvalidRequestError, TenantKV
from tenantkv.datapath.first_layers import FirstLayerGate
from tests.helpers import (
    MLA_SMALL,
    last_used,
    layers_equal,
    load_all,
    random_layers,
    random_tokens,
)
from tests.test_tenants import wait_for

TOKENS = 64  # one block


def _two_prefixes(kv: TenantKV) -> tuple[tenantkv.Namespace, list[list[int]], list[str]]:
    """A namespace holding two one-block prefixes; their tokens and extent ids, in order."""
    kv.create_tenant("t", quota_bytes=2**24)
    ns = kv.namespace("t", model="m", layout=MLA_SMALL)
    tokens, ids = [], []
    for seed in (1, 2):
        before = set(last_used(kv))
        tokens.append(random_tokens(TOKENS, seed=seed))
        assert ns.store(tokens[-1], random_layers(MLA_SMALL, TOKENS, seed=seed)) == TOKENS
        (new,) = set(last_used(kv)) - before
        ids.append(new)
    return ns, tokens, ids


# ---- the gate alone --------------------------------------------------------------------------


def test_gate_is_clear_without_holds_and_counts_them() -> None:
    gate = FirstLayerGate()
    assert gate.held == 0
    assert gate.wait_until_clear(time.monotonic()) is True  # nothing held: no wait at all
    first, second = gate.hold(), gate.hold()
    assert gate.held == 2
    first.release()
    first.release()  # again: nothing more happens
    assert gate.held == 1
    second.release()
    assert gate.held == 0


def test_gate_waits_until_its_deadline_while_held() -> None:
    gate = FirstLayerGate()
    hold = gate.hold()
    start = time.monotonic()
    assert gate.wait_until_clear(start + 0.1) is False
    assert time.monotonic() - start >= 0.1
    hold.release()
    assert gate.wait_until_clear(time.monotonic()) is True  # control: clear once released


def test_gate_wakes_a_waiter_when_the_last_hold_goes() -> None:
    gate = FirstLayerGate()
    holds = [gate.hold(), gate.hold()]
    result: list[bool] = []
    waiter = threading.Thread(
        target=lambda: result.append(gate.wait_until_clear(time.monotonic() + 60))
    )
    waiter.start()
    holds[0].release()
    time.sleep(0.05)
    assert not result  # one load is still before its first layer
    holds[1].release()
    waiter.join(timeout=10)
    assert result == [True]


# ---- loads hold it ---------------------------------------------------------------------------


def test_a_load_holds_the_gate_until_its_first_layer_is_handed_over(kv: TenantKV) -> None:
    ns, tokens, _ids = _two_prefixes(kv)
    gate = kv.context.runtime.first_layers
    with ns.load(tokens[0]) as first, ns.load(tokens[1]) as second:
        assert gate.held == 2  # both before their first layer
        first.wait_for_layer(0)
        assert gate.held == 1
        assert layers_equal(second.wait_for_layer(0), random_layers(MLA_SMALL, TOKENS, seed=2)[0])
        assert gate.held == 0  # the rest of the loads runs beside bookkeeping
    assert gate.held == 0


def test_loads_that_end_without_a_first_layer_let_go_of_the_gate(kv: TenantKV) -> None:
    ns, tokens, _ids = _two_prefixes(kv)
    gate = kv.context.runtime.first_layers
    with ns.load(tokens[0]):
        assert gate.held == 1
    assert gate.held == 0  # closed unread
    with pytest.raises(CacheMissError):
        ns.load(random_tokens(TOKENS, seed=99))
    with pytest.raises(InvalidRequestError):
        ns.load(tokens[0][:10])  # not a whole block
    with pytest.raises(InvalidRequestError):
        ns.load(tokens[0], device="tpu")
    assert gate.held == 0
    assert len(load_all(ns, tokens[0])) == MLA_SMALL.num_layers  # control: loads still work
    assert gate.held == 0


# ---- the record of use waits for them ---------------------------------------------------------


def test_record_of_use_waits_for_a_load_before_its_first_layer(
    kv: TenantKV, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        tenantkv.datapath.runtime, "BOOKKEEPING_HOLD_S", 60.0
    )  # no bound in this test
    ns, tokens, ids = _two_prefixes(kv)
    stored = last_used(kv)
    load_all(ns, tokens[0])  # its record of use goes to the background
    with ns.load(tokens[1]) as waiting:  # before its first layer, from now on
        time.sleep(10 * tenantkv.datapath.runtime.BOOKKEEPING_DELAY_S)
        assert last_used(kv)[ids[0]] == stored[ids[0]], "bookkeeping ran before a first layer"
        waiting.wait_for_layer(0)
        # Control: the record lands once that load has its first layer (well within the bound).
        wait_for(lambda: last_used(kv)[ids[0]] > stored[ids[0]])
    wait_for(lambda: last_used(kv)[ids[1]] > stored[ids[1]])  # and the second load's


def test_record_of_use_waits_at_most_the_bound(
    kv: TenantKV, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tenantkv.datapath.runtime, "BOOKKEEPING_HOLD_S", 0.3)
    ns, tokens, ids = _two_prefixes(kv)
    stored = last_used(kv)
    load_all(ns, tokens[0])
    with ns.load(tokens[1]):  # never read: before its first layer all along
        wait_for(lambda: last_used(kv)[ids[0]] > stored[ids[0]])
        assert kv.context.runtime.first_layers.held == 1  # it ran while the load still waited


def test_closing_does_not_wait_for_held_bookkeeping(
    kv: TenantKV, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tenantkv.datapath.runtime, "BOOKKEEPING_HOLD_S", 60.0)
    ns, tokens, _ids = _two_prefixes(kv)
    load_all(ns, tokens[0])
    left_open = ns.load(tokens[1])  # never read: it holds the gate until the cache closes it
    time.sleep(
        2 * tenantkv.datapath.runtime.BOOKKEEPING_DELAY_S
    )  # the record now waits on the gate
    start = time.monotonic()
    kv.close()
    assert time.monotonic() - start < 10  # far under the 60 s bound
    assert left_open.closed
    assert kv.context.runtime.first_layers.held == 0


def test_a_stream_dropped_unclosed_lets_go_of_the_gate(kv: TenantKV) -> None:
    ns, tokens, _ids = _two_prefixes(kv)
    gate = kv.context.runtime.first_layers
    ns.load(tokens[1])  # dropped at once, never read nor closed
    wait_for(lambda: gc.collect() >= 0 and gate.held == 0)
    with ns.load(tokens[0]):  # control: a load that is kept holds it
        gc.collect()
        assert gate.held == 1
