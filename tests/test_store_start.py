"""``store(start=)``: pass only the KV after a cached prefix; ``cached_length`` is not metered."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tenantkv
from tenantkv import InvalidRequestError, KVLayout, TenantKV
from tests.helpers import (
    MHA_SMALL,
    MLA_SMALL,
    layers_equal,
    load_all,
    prefix_of,
    random_layers,
    random_tokens,
)
from tests.indexes import Index


def _rows(layers: list[tenantkv.Layer], start: int, stop: int) -> list[tenantkv.Layer]:
    """Tokens ``start .. stop - 1`` of every layer."""
    out: list[tenantkv.Layer] = []
    for layer in layers:
        if isinstance(layer, tuple):
            out.append((layer[0][start:stop], layer[1][start:stop]))
        else:
            out.append(layer[start:stop])
    return out


@pytest.fixture
def acme(kv: TenantKV) -> TenantKV:
    kv.create_tenant("acme")
    return kv


@pytest.mark.parametrize("layout", [MLA_SMALL, MHA_SMALL], ids=["mla", "mha"])
def test_extending_with_only_the_new_rows_round_trips(acme: TenantKV, layout: KVLayout) -> None:
    ns = acme.namespace("acme", model="m", layout=layout)
    tokens = random_tokens(512, seed=1)
    layers = random_layers(layout, 512, seed=2)
    assert ns.store(tokens[:256], _rows(layers, 0, 256)) == 256
    assert ns.cached_length(tokens) == 256
    assert ns.store(tokens, _rows(layers, 256, 512), start=256) == 256
    assert ns.lookup(tokens) == 512
    for got, want in zip(load_all(ns, tokens), layers, strict=True):
        assert layers_equal(got, want)


def test_blocks_before_start_that_are_not_cached_are_skipped(acme: TenantKV) -> None:
    ns = acme.namespace("acme", model="m", layout=MLA_SMALL)
    tokens = random_tokens(512, seed=3)
    layers = random_layers(MLA_SMALL, 512, seed=4)
    # Nothing cached: only blocks 4..7 can be stored from rows 256..511; 0..3 stay missing.
    assert ns.store(tokens, _rows(layers, 256, 512), start=256) == 256
    assert ns.lookup(tokens) == 0
    assert sorted(ns.cached_blocks()) == [4, 5, 6, 7]
    # A store from 0 fills the gap, and the whole prefix loads exactly.
    assert ns.store(tokens, layers) == 256
    assert ns.lookup(tokens) == 512
    for got, want in zip(load_all(ns, tokens), layers, strict=True):
        assert layers_equal(got, want)


def test_start_equal_to_the_length_stores_nothing(acme: TenantKV) -> None:
    ns = acme.namespace("acme", model="m", layout=MLA_SMALL)
    tokens = random_tokens(128, seed=5)
    assert ns.store(tokens, _rows(random_layers(MLA_SMALL, 128), 128, 128), start=128) == 0
    assert ns.lookup(tokens) == 0


@pytest.mark.parametrize("start", [-64, 10, 192, True, 64.0, "64"])
def test_bad_start_is_refused_and_nothing_is_stored(acme: TenantKV, start: object) -> None:
    ns = acme.namespace("acme", model="m", layout=MLA_SMALL)
    tokens = random_tokens(128, seed=6)
    layers = random_layers(MLA_SMALL, 128, seed=7)
    with pytest.raises(InvalidRequestError, match="start"):
        ns.store(tokens, layers, start=start)  # type: ignore[arg-type]
    assert ns.cached_length(tokens) == 0
    assert list(ns.cached_blocks()) == []


def test_rows_must_cover_exactly_the_tokens_after_start(acme: TenantKV) -> None:
    ns = acme.namespace("acme", model="m", layout=MLA_SMALL)
    tokens = random_tokens(256, seed=8)
    layers = random_layers(MLA_SMALL, 256, seed=9)
    with pytest.raises(InvalidRequestError, match="shape"):
        ns.store(tokens, layers, start=64)  # all 256 rows, where 192 are expected
    with pytest.raises(InvalidRequestError, match="shape"):
        ns.store(tokens, _rows(layers, 0, 64), start=64)
    assert list(ns.cached_blocks()) == []


def test_cached_length_is_not_metered_and_agrees_with_lookup(acme: TenantKV) -> None:
    ns = acme.namespace("acme", model="m", layout=MLA_SMALL)
    tokens = random_tokens(300, seed=10)
    ns.store(tokens, random_layers(MLA_SMALL, 300, seed=11))
    before = acme.usage("acme").counters
    assert ns.cached_length(tokens) == 256
    assert ns.cached_length(tokens[:100]) == 64
    assert ns.cached_length([]) == 0
    assert acme.usage("acme").counters == before
    assert ns.lookup(tokens) == 256  # the control: lookup is metered
    assert acme.usage("acme")["hit_tokens"] == before["hit_tokens"] + 256


def test_any_split_loads_the_same_bytes_as_one_store(
    tmp_path_factory: pytest.TempPathFactory, index: Index
) -> None:
    """Against the model "a block is cached iff some store had its rows": the cached prefix
    is the run of such blocks from 0, and every loaded byte equals the original."""

    @settings(max_examples=index.examples(25), deadline=None)
    @given(
        first=st.integers(min_value=0, max_value=6),
        start=st.integers(min_value=0, max_value=8),
        total=st.integers(min_value=0, max_value=8),
    )
    def check(first: int, start: int, total: int) -> None:
        start = min(start, total)
        root = tmp_path_factory.mktemp("split")
        with tenantkv.open(root, durable=False) as kv:
            kv.create_tenant("acme")
            ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
            tokens = random_tokens(64 * 8, seed=12)
            layers = random_layers(MLA_SMALL, 64 * 8, seed=13)
            ns.store(tokens[: 64 * first], _rows(layers, 0, 64 * first))
            ns.store(tokens[: 64 * total], _rows(layers, 64 * start, 64 * total), start=64 * start)
            model = set(range(first)) | set(range(start, total))
            expected = 0
            while expected in model:
                expected += 1
            assert ns.lookup(tokens) == 64 * expected
            if expected:
                loaded = load_all(ns, tokens[: 64 * expected])
                for got, want in zip(loaded, layers, strict=True):
                    assert layers_equal(got, prefix_of(want, 64 * expected))

    check()
