"""Loads that skip the prefix's first blocks (``Namespace.load(skip_blocks=)``): an engine whose
own prefix cache holds them asks only for the blocks after, and nothing is decrypted for it to
throw away."""

from __future__ import annotations

import pytest
import torch

import tenantkv
from tests.helpers import MHA_SMALL, MLA_SMALL, layers_equal, random_layers, random_tokens

BLOCK = 32


def _stored(
    kv: tenantkv.TenantKV, tenant: str, layout: tenantkv.KVLayout
) -> tuple[tenantkv.Namespace, list[int], list[tenantkv.Layer]]:
    if tenant not in {t.name for t in kv.list_tenants()}:
        kv.create_tenant(tenant)
    ns = kv.namespace(tenant, model="m", layout=layout, block_tokens=BLOCK)
    tokens = random_tokens(4 * BLOCK, seed=7)
    layers = random_layers(layout, 4 * BLOCK, seed=7)
    assert ns.store(tokens, layers) == 4 * BLOCK
    return ns, tokens, layers


MHA_PAGES = tenantkv.KVLayout.mha_pages(
    num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=BLOCK, dtype=torch.float16
)


def _after(layer: tenantkv.Layer, blocks: int, layout: tenantkv.KVLayout) -> tenantkv.Layer:
    """The part of a stored layer after its first ``blocks`` blocks."""
    if isinstance(layer, torch.Tensor):  # rows, or whole pages (one block each)
        return layer[blocks if layout.kind == "mha-pages" else blocks * BLOCK :]
    return layer[0][blocks * BLOCK :], layer[1][blocks * BLOCK :]


@pytest.mark.parametrize(
    "layout", [MLA_SMALL, MHA_SMALL, MHA_PAGES], ids=["mla", "mha", "mha-pages"]
)
def test_fresh_layers_hold_only_the_blocks_after_those_skipped(
    kv: tenantkv.TenantKV, layout: tenantkv.KVLayout
) -> None:
    ns, tokens, layers = _stored(kv, "acme", layout)
    for skip in (1, 3):
        with ns.load(tokens, skip_blocks=skip) as stream:
            assert stream.num_tokens == (4 - skip) * BLOCK
            got = [layer for _, layer in stream]
        want = [_after(layer, skip, layout) for layer in layers]
        assert all(layers_equal(a, b) for a, b in zip(got, want, strict=True))
    # Control: without skip_blocks the whole prefix comes back.
    with ns.load(tokens) as whole:
        assert all(layers_equal(a, b) for (_, a), b in zip(whole, layers, strict=True))


def test_out_buffers_receive_the_remaining_blocks_where_block_rows_say(
    kv: tenantkv.TenantKV,
) -> None:
    ns, tokens, layers = _stored(kv, "acme", MLA_SMALL)
    width = MLA_SMALL.values_per_token
    out = [torch.zeros(6 * BLOCK, width, dtype=MLA_SMALL.dtype) for _ in layers]
    # the engine has block 0; blocks 1, 2, 3 go to pages 5, 0, 2
    with ns.load(tokens, out=out, block_rows=[5 * BLOCK, 0, 2 * BLOCK], skip_blocks=1) as stream:
        for index, buffer in stream:
            stored = layers[index]
            assert isinstance(stored, torch.Tensor)
            assert torch.equal(buffer[5 * BLOCK :], stored[BLOCK : 2 * BLOCK])
            assert torch.equal(buffer[:BLOCK], stored[2 * BLOCK : 3 * BLOCK])
            assert torch.equal(buffer[2 * BLOCK : 3 * BLOCK], stored[3 * BLOCK :])
            assert not buffer[BLOCK : 2 * BLOCK].any() and not buffer[3 * BLOCK : 5 * BLOCK].any()
    with pytest.raises(tenantkv.InvalidRequestError, match="block_rows has 4 entries"):
        ns.load(tokens, out=out, block_rows=[0, BLOCK, 2 * BLOCK, 3 * BLOCK], skip_blocks=1)


def test_the_blocks_after_a_skip_are_the_tenants_own(kv: tenantkv.TenantKV) -> None:
    """The remaining blocks' keys chain from the whole prefix under the tenant's own key: a
    tenant that never stored it finds nothing, however many blocks it skips."""
    owner, tokens, layers = _stored(kv, "acme", MLA_SMALL)
    kv.create_tenant("globex")
    other = kv.namespace("globex", model="m", layout=MLA_SMALL, block_tokens=BLOCK)
    for skip in (1, 3):
        with pytest.raises(tenantkv.CacheMissError):
            other.load(tokens, skip_blocks=skip)
        with owner.load(tokens, skip_blocks=skip) as stream:  # positive control
            assert layers_equal(stream.wait_for_layer(0), _after(layers[0], skip, MLA_SMALL))


def test_a_skip_that_leaves_nothing_or_is_not_a_count_is_refused(kv: tenantkv.TenantKV) -> None:
    ns, tokens, layers = _stored(kv, "acme", MLA_SMALL)
    for bad in (-1, 4, 5):
        with pytest.raises(tenantkv.InvalidRequestError, match="at least one"):
            ns.load(tokens, skip_blocks=bad)
    for not_a_count in (True, 1.0, "1"):
        with pytest.raises(tenantkv.InvalidRequestError, match="an integer"):
            ns.load(tokens, skip_blocks=not_a_count)  # type: ignore[arg-type]
    with ns.load(tokens, skip_blocks=0) as stream:  # control: 0 is the whole prefix
        assert layers_equal(stream.wait_for_layer(0), layers[0])
