"""Edited prefixes in the store: drop+repos applied to a cached prefix, sealed on a key chain of
their own (derived from the parent's key and the edit script), loaded back byte-exact, extended
by later tokens, metered like any store, and invisible to every other namespace.

Every isolation check first shows the owner's hit (positive control).
"""

from __future__ import annotations

import pytest

from tenantkv import InvalidRequestError, KVLayout, TenantKV
from tenantkv.editing import EditScript, RopeSpec, edit_layers
from tenantkv.services.editing import edit_cached_prefix
from tests.helpers import (
    MHA_SMALL,
    MLA_SMALL,
    layers_equal,
    load_all,
    prefix_of,
    random_layers,
    random_tokens,
)

TOKENS = random_tokens(256, seed=17)
# 50 dropped: 206 retained, 3 full blocks of which block 0 (before the first span) is shared
SCRIPT = EditScript.dropping([(70, 100), (150, 170)])


def _rope(layout: KVLayout) -> RopeSpec:
    dims = layout.rope_dim if layout.kind == "mla" else layout.head_dim
    return RopeSpec.standard(10000.0, dims, "interleaved" if layout.kind == "mla" else "half")


@pytest.fixture
def tenants(kv: TenantKV) -> TenantKV:
    kv.create_tenant("acme")
    kv.create_tenant("globex")
    return kv


@pytest.mark.parametrize("layout", [MLA_SMALL, MHA_SMALL], ids=["mla", "mha"])
def test_an_edited_prefix_round_trips_through_store_and_load(
    tenants: TenantKV, layout: KVLayout
) -> None:
    ns = tenants.namespace("acme", model="m", layout=layout)
    layers = random_layers(layout, len(TOKENS), seed=3)
    assert ns.store(TOKENS, layers) == 256
    rope = _rope(layout)

    result = edit_cached_prefix(ns, TOKENS, SCRIPT, rope, kind="agent")
    assert result.origin is not None and result.origin.depth == 1
    assert result.origin.dropped_tokens == 50 and result.origin.shared_blocks == 1
    assert result.tokens.tolist() == TOKENS[:70] + TOKENS[100:150] + TOKENS[170:]
    assert result.stored_tokens == 128  # only what changed: block 0 is the parent's
    edited_tokens = result.tokens.tolist()
    assert ns.lookup(edited_tokens, origin=result.origin) == 192
    expected = edit_layers(layout, layers, 256, SCRIPT, rope)
    for got, want in zip(
        load_all_edited(ns, edited_tokens[:192], result.origin), expected, strict=True
    ):
        assert layers_equal(got, prefix_of(want, 192))
    # Not the unedited prefix of the same tokens: on the unedited chain only the first block,
    # which lies before the first dropped span and so is the parent's own, hits.
    assert ns.lookup(edited_tokens) == 64
    # A key match is a prefix match: other tokens in the shared block, even cached ones, give
    # other keys after it, so the edited blocks are not served after them.
    other_head = random_tokens(64, seed=18)
    ns.store(other_head, prefix_of_layers(layout, layers, 64))
    assert ns.lookup(other_head + edited_tokens[64:], origin=result.origin) == 64
    # The parent is still there, unchanged.
    assert ns.lookup(TOKENS) == 256
    for got, want in zip(load_all(ns, TOKENS), layers, strict=True):
        assert layers_equal(got, want)
    # Editing the same prefix with the same script again finds it stored.
    assert edit_cached_prefix(ns, TOKENS, SCRIPT, rope).stored_tokens == 0


def prefix_of_layers(layout: KVLayout, layers: list[object], length: int) -> list[object]:
    return [prefix_of(layer, length) for layer in layers]  # type: ignore[arg-type]


def load_all_edited(ns: object, tokens: list[int], origin: object) -> list[object]:
    out = []
    with ns.load(tokens, origin=origin) as stream:  # type: ignore[attr-defined]
        for index, layer in stream:
            assert index == len(out)
            out.append(layer)
    return out


def test_the_next_turn_extends_an_edited_prefix_and_edits_nest(tenants: TenantKV) -> None:
    ns = tenants.namespace("acme", model="m", layout=MLA_SMALL)
    layers = random_layers(MLA_SMALL, 256, seed=4)
    ns.store(TOKENS, layers)
    rope = _rope(MLA_SMALL)
    first = edit_cached_prefix(ns, TOKENS, SCRIPT, rope)
    assert first.origin is not None
    # The next turn: the 206 retained tokens, then 90 new ones (computed by the model after
    # the edit; random here), stored from the first uncached block on.
    turn = first.tokens.tolist() + random_tokens(90, seed=5)
    assert ns.cached_length(turn, origin=first.origin) == 192
    new_rows = random_layers(MLA_SMALL, len(turn) - 192, seed=6)
    assert ns.store(turn, new_rows, start=192, origin=first.origin) == 64
    assert ns.lookup(turn, origin=first.origin) == 256
    # A second edit of the edited prefix: its own chain again, one level deeper.
    again = EditScript.dropping([(10, 20)])
    second = edit_cached_prefix(ns, turn[:256], again, rope, origin=first.origin)
    assert second.origin is not None and second.origin.depth == 2
    assert second.origin.dropped_tokens == 60 and second.origin.shared_blocks == 0
    assert second.stored_tokens == 192  # 246 retained tokens: 3 full blocks, none shared
    assert ns.lookup(second.tokens.tolist(), origin=second.origin) == 192
    assert ns.lookup(second.tokens.tolist(), origin=first.origin) == 0


def test_an_edit_that_drops_nothing_cached_stays_on_the_parent_chain(tenants: TenantKV) -> None:
    """Dropping only tokens after the cached prefix leaves its cache as it is: the edited
    sequence is then an ordinary extension of the parent (no new chain, nothing stored)."""
    ns = tenants.namespace("acme", model="m", layout=MLA_SMALL)
    ns.store(TOKENS, random_layers(MLA_SMALL, 256))
    later = EditScript.dropping([(300, 320)])
    assert ns.edited(TOKENS, later) is None
    result = edit_cached_prefix(ns, TOKENS, later, _rope(MLA_SMALL))
    assert (result.origin, result.stored_tokens) == (None, 0)
    assert ns.lookup(result.tokens.tolist()) == 256


def test_edits_are_metered_like_other_loads_and_stores(tenants: TenantKV) -> None:
    ns = tenants.namespace("acme", model="m", layout=MHA_SMALL, scope="agent-1")
    ns.store(TOKENS, random_layers(MHA_SMALL, 256))
    before = tenants.usage("acme", scope="agent-1")
    edit_cached_prefix(ns, TOKENS, SCRIPT, _rope(MHA_SMALL))
    after = tenants.usage("acme", scope="agent-1")
    assert after["served_tokens"] - before["served_tokens"] == 256  # the parent's load
    assert after["stored_tokens"] - before["stored_tokens"] == 128  # the changed blocks
    assert after["stored_bytes"] > before["stored_bytes"]


def test_one_namespaces_edits_are_invisible_to_another(tenants: TenantKV) -> None:
    layers = random_layers(MLA_SMALL, 256, seed=8)
    mine = tenants.namespace("acme", model="m", layout=MLA_SMALL, scope="alice")
    mine.store(TOKENS, layers)
    result = edit_cached_prefix(mine, TOKENS, SCRIPT, _rope(MLA_SMALL))
    edited_tokens = result.tokens.tolist()
    assert mine.lookup(edited_tokens, origin=result.origin) == 192  # the owner's hit (control)

    others = [
        tenants.namespace("globex", model="m", layout=MLA_SMALL, scope="alice"),
        tenants.namespace("acme", model="m", layout=MLA_SMALL, scope="bob"),
        tenants.namespace("acme", model="m", layout=MLA_SMALL),
    ]
    for other in others:
        # The same parent, script and tokens, derived under the other namespace's key: nothing
        # of the owner's edit is found, before or after the other stores the parent itself
        # (then only its own parent's first block, which its edit shares, hits).
        theirs = other.edited(TOKENS, SCRIPT)
        assert theirs is not None and theirs.binding != result.origin.binding
        assert other.lookup(edited_tokens, origin=theirs) == 0
        other.store(TOKENS, layers)
        assert other.lookup(edited_tokens, origin=theirs) == 64
        # Another namespace's edited prefix cannot be used at all.
        with pytest.raises(InvalidRequestError, match="another namespace"):
            other.lookup(edited_tokens, origin=result.origin)
        with pytest.raises(InvalidRequestError, match="another namespace"):
            other.load(edited_tokens[:192], origin=result.origin)
    assert mine.lookup(edited_tokens, origin=result.origin) == 192


def test_edits_of_a_prefix_that_is_not_all_cached_are_refused(tenants: TenantKV) -> None:
    ns = tenants.namespace("acme", model="m", layout=MLA_SMALL)
    ns.store(TOKENS[:128], random_layers(MLA_SMALL, 128))
    with pytest.raises(InvalidRequestError, match="whole"):
        ns.edited(TOKENS[:100], SCRIPT)
    with pytest.raises(InvalidRequestError, match="EditScript"):
        ns.edited(TOKENS[:128], [(1, 2)])  # type: ignore[arg-type]
    from tenantkv import CacheMissError

    with pytest.raises(CacheMissError):
        edit_cached_prefix(ns, TOKENS, SCRIPT, _rope(MLA_SMALL))
    assert ns.lookup(TOKENS) == 128  # nothing changed
