"""Property-based tests (Hypothesis): store / lookup / load against simple models.

One real cache (SQLite + local files + key file) is opened per test function; every Hypothesis
example gets fresh tenant names, so examples never see each other's entries.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)

import tenantkv
from tenantkv import BLOCK_TOKENS, KVLayout, Layer, Namespace, TenantKV

from .helpers import layers_equal, load_all, prefix_of, random_layers

PROPERTY_SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_names = itertools.count()


def fresh_name(stem: str) -> str:
    """A tenant name never used before in this process."""
    return f"{stem}-{next(_names)}"


@contextmanager
def fresh_cache() -> Iterator[TenantKV]:
    with (
        tempfile.TemporaryDirectory(prefix="tenantkv-prop-") as root,
        tenantkv.open(root, durable=False, workers=2) as kv,
    ):
        yield kv


# ---- strategies ---------------------------------------------------------------------------------

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@st.composite
def layouts(draw: st.DrawFn) -> KVLayout:
    dtype = draw(st.sampled_from(DTYPES))
    num_layers = draw(st.integers(1, 3))
    if draw(st.booleans()):
        return KVLayout.mla(
            num_layers=num_layers,
            kv_lora_rank=draw(st.integers(1, 12)),
            rope_dim=draw(st.integers(1, 4)),
            dtype=dtype,
        )
    return KVLayout.mha(
        num_layers=num_layers,
        num_kv_heads=draw(st.integers(1, 2)),
        head_dim=draw(st.integers(1, 4)),
        dtype=dtype,
    )


def token_lists(
    min_len: int = 0, max_len: int = 600, vocab: int = 3
) -> st.SearchStrategy[list[int]]:
    """Token lists whose length is spread evenly over [min_len, max_len] (small vocabulary)."""
    return st.integers(min_len, max_len).flatmap(
        lambda n: st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)
    )


# A pool of 64-token blocks, two of which differ only in their last token, so sequences built from
# it share whole-block prefixes often and sometimes diverge inside a block.
_rng = np.random.default_rng(1234)
BLOCK_POOL: list[list[int]] = [_rng.integers(0, 4, BLOCK_TOKENS).tolist() for _ in range(3)]
BLOCK_POOL.append([*BLOCK_POOL[0][:-1], (BLOCK_POOL[0][-1] + 1) % 4])


@st.composite
def pooled_tokens(draw: st.DrawFn, max_blocks: int = 9) -> list[int]:
    """Whole blocks from :data:`BLOCK_POOL` followed by a partial tail (0..63 tokens)."""
    picks = draw(st.lists(st.integers(0, len(BLOCK_POOL) - 1), max_size=max_blocks))
    tail = draw(st.lists(st.integers(0, 3), max_size=BLOCK_TOKENS - 1))
    tokens: list[int] = []
    for pick in picks:
        tokens.extend(BLOCK_POOL[pick])
    return tokens + tail


def as_container(tokens: list[int], kind: str) -> Any:
    """The same token ids as a list, a 1-D int64 tensor or a 1-D int32 numpy array."""
    if kind == "tensor":
        return torch.tensor(tokens, dtype=torch.int64)
    if kind == "numpy":
        return np.asarray(tokens, dtype=np.int32)
    return list(tokens)


CONTAINERS = st.sampled_from(["list", "tensor", "numpy"])


# ---- model helpers ------------------------------------------------------------------------------


def full_block_tokens(n: int) -> int:
    return (n // BLOCK_TOKENS) * BLOCK_TOKENS


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def block_prefixes(tokens: Sequence[int]) -> list[tuple[int, ...]]:
    """The model's key of every full block: the tuple of all tokens up to the block's end."""
    return [tuple(tokens[: (k + 1) * BLOCK_TOKENS]) for k in range(len(tokens) // BLOCK_TOKENS)]


def block_slice(layer: Layer, block: int) -> Layer:
    lo, hi = block * BLOCK_TOKENS, (block + 1) * BLOCK_TOKENS
    if isinstance(layer, torch.Tensor):
        return layer[lo:hi].clone()
    return layer[0][lo:hi].clone(), layer[1][lo:hi].clone()


def concat_blocks(blocks: Sequence[Layer]) -> Layer:
    first = blocks[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([b for b in blocks if isinstance(b, torch.Tensor)])
    pairs = [b for b in blocks if isinstance(b, tuple)]
    return torch.cat([k for k, _ in pairs]), torch.cat([v for _, v in pairs])


def assert_layers_exact(got: Sequence[Layer], want: Sequence[Layer], layout: KVLayout) -> None:
    assert len(got) == len(want) == layout.num_layers
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        if layout.kind == "mla":
            assert isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor)
            assert g.dtype == layout.dtype and g.shape == w.shape, f"layer {index}"
            assert torch.equal(g, w), f"layer {index} differs"
        else:
            assert isinstance(g, tuple) and isinstance(w, tuple)
            for part, gp, wp in (("k", g[0], w[0]), ("v", g[1], w[1])):
                assert gp.dtype == layout.dtype and gp.shape == wp.shape, f"layer {index} {part}"
                assert torch.equal(gp, wp), f"layer {index} {part} differs"


def new_namespace(kv: TenantKV, layout: KVLayout, scope: str | None = None) -> Namespace:
    tenant = fresh_name("t")
    kv.create_tenant(tenant)
    return kv.namespace(tenant, model="prop-model", layout=layout, scope=scope)


# ---- (a) store then lookup / load round trip ----------------------------------------------------


@pytest.mark.usefixtures("index")
def test_store_lookup_load_roundtrip() -> None:
    with fresh_cache() as kv:

        @PROPERTY_SETTINGS
        @given(
            layout=layouts(),
            tokens=token_lists(),
            seed=st.integers(0, 2**31 - 1),
            store_as=CONTAINERS,
            lookup_as=CONTAINERS,
        )
        def check(
            layout: KVLayout, tokens: list[int], seed: int, store_as: str, lookup_as: str
        ) -> None:
            note(f"layout={layout.describe()} len={len(tokens)}")
            ns = new_namespace(kv, layout)
            layers = random_layers(layout, len(tokens), seed=seed)
            expected = full_block_tokens(len(tokens))
            assert ns.store(as_container(tokens, store_as), layers) == expected
            assert ns.lookup(as_container(tokens, lookup_as)) == expected
            if expected == 0:
                with pytest.raises(tenantkv.InvalidRequestError):
                    ns.load(tokens[:expected])
                return
            loaded = load_all(ns, tokens[:expected])
            assert_layers_exact(loaded, [prefix_of(layer, expected) for layer in layers], layout)
            # Every shorter whole-block prefix is cached and loads exactly too.
            shorter = BLOCK_TOKENS * ((seed % (expected // BLOCK_TOKENS)) + 1)
            assert ns.lookup(tokens[:shorter]) == shorter
            loaded = load_all(ns, tokens[:shorter])
            assert_layers_exact(loaded, [prefix_of(layer, shorter) for layer in layers], layout)

        check()


# ---- (b) two sequences with a common prefix -----------------------------------------------------


@pytest.mark.usefixtures("index")
def test_lookup_of_sequence_sharing_a_prefix() -> None:
    with fresh_cache() as kv:

        @PROPERTY_SETTINGS
        @given(
            layout=layouts(),
            common=token_lists(0, 600),
            rest_a=token_lists(0, 150),
            rest_b=token_lists(0, 150),
            echo=st.booleans(),
            seed=st.integers(0, 2**31 - 1),
        )
        def check(
            layout: KVLayout,
            common: list[int],
            rest_a: list[int],
            rest_b: list[int],
            echo: bool,
            seed: int,
        ) -> None:
            if echo:  # the second sequence repeats the start of the first one's rest, too
                rest_b = rest_a[: len(rest_b)] + rest_b
            first = common + rest_a
            second = common + rest_b
            shared = common_prefix_len(first, second)  # may exceed len(common) by chance
            assert shared >= len(common)
            note(f"len(first)={len(first)} len(second)={len(second)} shared={shared}")
            ns = new_namespace(kv, layout)
            ns.store(first, random_layers(layout, len(first), seed=seed))
            expected = BLOCK_TOKENS * (shared // BLOCK_TOKENS)
            assert ns.lookup(second) == expected
            # The loaded shared prefix is the first sequence's data.
            if expected:
                layers = random_layers(layout, len(first), seed=seed)
                loaded = load_all(ns, second[:expected])
                assert_layers_exact(
                    loaded, [prefix_of(layer, expected) for layer in layers], layout
                )
            # One block past the shared part is not cached (when the second sequence has one).
            if len(second) >= expected + BLOCK_TOKENS:
                with pytest.raises(tenantkv.CacheMissError):
                    ns.load(second[: expected + BLOCK_TOKENS])

        check()


# ---- (c) store returns exactly the newly stored full-block tokens -------------------------------


@pytest.mark.usefixtures("index")
def test_store_returns_new_full_block_tokens() -> None:
    with fresh_cache() as kv:

        @PROPERTY_SETTINGS
        @given(
            layout=layouts(),
            sequences=st.lists(pooled_tokens(), min_size=1, max_size=5),
            seed=st.integers(0, 2**31 - 1),
        )
        def check(layout: KVLayout, sequences: list[list[int]], seed: int) -> None:
            ns = new_namespace(kv, layout)
            stored: set[tuple[int, ...]] = set()
            for index, tokens in enumerate(sequences):
                layers = random_layers(layout, len(tokens), seed=seed + index)
                prefixes = block_prefixes(tokens)
                expected = BLOCK_TOKENS * sum(1 for p in prefixes if p not in stored)
                note(f"store #{index}: len={len(tokens)} expected new={expected}")
                assert ns.store(tokens, layers) == expected
                stored.update(prefixes)
                assert ns.store(tokens, layers) == 0, "storing the same again stores nothing"
                assert ns.lookup(tokens) == full_block_tokens(len(tokens))
            assert sorted(ns.cached_blocks()) == sorted(len(p) // BLOCK_TOKENS - 1 for p in stored)

        check()


# ---- (d) stateful: several namespaces against a dict model --------------------------------------

NamespaceModel = dict[tuple[int, ...], list[Layer]]
"""Block prefix (all tokens up to the block's end) -> that block's data, per layer."""


class NamespaceMachine(RuleBasedStateMachine):
    """Two tenants, one of them with two scopes, sharing a layout and a model."""

    stored = Bundle("stored")

    def __init__(self, kv: TenantKV) -> None:
        super().__init__()
        self.kv = kv
        self.layout: KVLayout | None = None
        self.spaces: list[Namespace] = []
        self.models: list[NamespaceModel] = []
        self.seeds = itertools.count()

    @initialize(layout=layouts())
    def open_namespaces(self, layout: KVLayout) -> None:
        self.layout = layout
        alpha, beta = fresh_name("alpha"), fresh_name("beta")
        self.kv.create_tenant(alpha)
        self.kv.create_tenant(beta)
        model = "stateful-model"
        self.spaces = [
            self.kv.namespace(alpha, model=model, layout=layout),
            self.kv.namespace(beta, model=model, layout=layout, scope="one"),
            self.kv.namespace(beta, model=model, layout=layout, scope="two"),
        ]
        self.models = [{} for _ in self.spaces]
        note(f"layout={layout.describe()}")

    def cached_len(self, index: int, tokens: Sequence[int]) -> int:
        """The model's longest cached prefix of ``tokens`` in namespace ``index``."""
        model = self.models[index]
        blocks = 0
        for prefix in block_prefixes(tokens):
            if prefix not in model:
                break
            blocks += 1
        return blocks * BLOCK_TOKENS

    def expected_layers(self, index: int, tokens: Sequence[int]) -> list[Layer]:
        assert self.layout is not None
        model = self.models[index]
        per_block = [model[p] for p in block_prefixes(tokens)]
        return [
            concat_blocks([block[layer] for block in per_block])
            for layer in range(self.layout.num_layers)
        ]

    @rule(target=stored, space=st.integers(0, 2), tokens=pooled_tokens(), container=CONTAINERS)
    def store(self, space: int, tokens: list[int], container: str) -> tuple[int, list[int]]:
        assert self.layout is not None
        layers = random_layers(self.layout, len(tokens), seed=next(self.seeds))
        model = self.models[space]
        prefixes = block_prefixes(tokens)
        expected = BLOCK_TOKENS * sum(1 for p in prefixes if p not in model)
        got = self.spaces[space].store(as_container(tokens, container), layers)
        note(f"store ns{space} len={len(tokens)} -> {got} (model {expected})")
        assert got == expected
        for block, prefix in enumerate(prefixes):
            if prefix not in model:  # the first writer of a block wins
                model[prefix] = [block_slice(layer, block) for layer in layers]
        return space, tokens

    @rule(space=st.integers(0, 2), tokens=pooled_tokens(), container=CONTAINERS)
    def lookup(self, space: int, tokens: list[int], container: str) -> None:
        got = self.spaces[space].lookup(as_container(tokens, container))
        expected = self.cached_len(space, tokens)
        note(f"lookup ns{space} len={len(tokens)} -> {got} (model {expected})")
        assert got == expected

    @rule(space=st.integers(0, 2), tokens=pooled_tokens())
    def load(self, space: int, tokens: list[int]) -> None:
        self.check_load(space, tokens)

    @rule(entry=stored, space=st.integers(0, 2), cut=st.integers(0, 640))
    def load_stored(self, entry: tuple[int, list[int]], space: int, cut: int) -> None:
        """Load (a prefix of) what some namespace stored, in a random namespace."""
        self.check_load(space, entry[1][:cut])

    def check_load(self, space: int, tokens: list[int]) -> None:
        """Load the model's cached prefix exactly; one block more is a CacheMissError."""
        assert self.layout is not None
        ns = self.spaces[space]
        cached = self.cached_len(space, tokens)
        note(f"load ns{space} len={len(tokens)} cached={cached}")
        if cached:
            loaded = load_all(ns, tokens[:cached])
            assert_layers_exact(loaded, self.expected_layers(space, tokens[:cached]), self.layout)
        if len(tokens) >= cached + BLOCK_TOKENS:
            with pytest.raises(tenantkv.CacheMissError):
                ns.load(tokens[: cached + BLOCK_TOKENS])

    @rule(entry=stored)
    def isolation(self, entry: tuple[int, list[int]]) -> None:
        """What one namespace stored is cached for it and for no other namespace."""
        owner, tokens = entry
        full = full_block_tokens(len(tokens))
        assert self.spaces[owner].lookup(tokens) == full  # positive control: the owner hits
        for other in range(len(self.spaces)):
            got = self.spaces[other].lookup(tokens)
            assert got == self.cached_len(other, tokens), f"ns{other} sees ns{owner}'s entries"
            if other != owner and full and got < full:
                with pytest.raises(tenantkv.CacheMissError):
                    self.spaces[other].load(tokens[:full])


@pytest.mark.usefixtures("index")
def test_namespaces_against_dict_model() -> None:
    with fresh_cache() as kv:

        class BoundMachine(NamespaceMachine):
            def __init__(self) -> None:
                super().__init__(kv)

        run_state_machine_as_test(
            BoundMachine,
            settings=settings(
                max_examples=25,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            ),
        )


def test_layer_equality_helper_is_strict() -> None:
    """Positive control for the comparisons above: a one-value change is detected."""
    layout = KVLayout.mha(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float16)
    (layer,) = random_layers(layout, BLOCK_TOKENS, seed=3)
    assert isinstance(layer, tuple)
    changed = (layer[0].clone(), layer[1].clone())
    changed[1][5, 0, 1] += 1
    assert layers_equal(layer, layer)
    assert not layers_equal(layer, changed)
    with pytest.raises(AssertionError):
        assert_layers_exact([changed], [layer], layout)
