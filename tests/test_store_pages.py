"""``Namespace.store_pages``: independent one-block prefixes stored as one extent, each found
and loaded again on its own (SGLang's HiCache batches), exactly and per tenant."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tenantkv import KVLayout, TenantKV
from tenantkv.errors import InvalidRequestError
from tests.helpers import layers_equal, load_all, random_layers, random_tokens

LAYOUT = KVLayout.mla(2, kv_lora_rank=32, rope_dim=8, dtype=torch.bfloat16)


def extents(root: Path) -> int:
    """Extent files in the cache's block directory."""
    return len([p for p in (root / "blocks").rglob("*") if p.is_file()])


def test_a_batch_of_pages_is_one_extent_and_each_page_loads_alone(
    kv: TenantKV, cache_root: Path
) -> None:
    kv.create_tenant("acme")
    kv.create_tenant("globex")
    ns = kv.namespace("acme", model="m", layout=LAYOUT)
    pages = [random_tokens(64, seed=i) for i in range(5)]
    layers = random_layers(LAYOUT, 5 * 64)
    files_before = extents(cache_root)
    assert ns.store_pages(pages, layers) == 5 * 64
    assert extents(cache_root) == files_before + 1  # one extent for the batch
    for i in reversed(range(5)):  # any page, in any order, on its own
        assert ns.lookup(pages[i]) == 64
        for got, want in zip(load_all(ns, pages[i]), layers, strict=True):
            assert layers_equal(got, want[i * 64 : (i + 1) * 64])
    # already cached pages are skipped; a new one in the batch is stored
    fresh = random_tokens(64, seed=99)
    more = random_layers(LAYOUT, 2 * 64)
    assert ns.store_pages([pages[0], fresh], more) == 64
    assert layers_equal(load_all(ns, fresh)[1], more[1][64:])
    # another tenant's namespace finds none of them
    other = kv.namespace("globex", model="m", layout=LAYOUT)
    assert all(other.lookup(page) == 0 for page in pages)


def test_bad_pages_are_refused_before_anything_is_written(kv: TenantKV, cache_root: Path) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=LAYOUT)
    files_before = extents(cache_root)
    with pytest.raises(InvalidRequestError):
        ns.store_pages([random_tokens(64), random_tokens(63)], random_layers(LAYOUT, 127))
    with pytest.raises(InvalidRequestError):
        ns.store_pages([random_tokens(64)], random_layers(LAYOUT, 128))
    assert extents(cache_root) == files_before
    assert ns.store_pages([], random_layers(LAYOUT, 0)) == 0


MHA = KVLayout.mha(2, num_kv_heads=2, head_dim=8, dtype=torch.float16)


@pytest.mark.parametrize("layout", [LAYOUT, MHA], ids=["mla", "mha"])
def test_a_batch_of_pages_loads_with_one_open_per_extent(
    kv: TenantKV, layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``load_pages`` plans the pages found together: pages from two batches (two extents),
    asked for out of order, with a repeat and a page never stored, open each extent once and
    come back exactly, each page's own rows; the missing page is a miss for itself alone."""
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=layout)
    pages = [random_tokens(64, seed=10 + i) for i in range(6)]
    first, second = random_layers(layout, 3 * 64, seed=1), random_layers(layout, 3 * 64, seed=2)
    assert ns.store_pages(pages[:3], first) == 3 * 64
    assert ns.store_pages(pages[3:], second) == 3 * 64
    stored = {
        i: [prefix_rows(layer, i % 3) for layer in (first if i < 3 else second)] for i in range(6)
    }
    blocks = kv.context.blocks
    opened: list[str] = []
    real_open = blocks.open

    def counting_open(extent_id: str) -> object:
        opened.append(extent_id)
        return real_open(extent_id)

    monkeypatch.setattr(blocks, "open", counting_open)
    never = random_tokens(64, seed=99)
    asked = [pages[4], pages[0], never, pages[2], pages[1], pages[0], pages[5], pages[3]]
    which = [4, 0, None, 2, 1, 0, 5, 3]
    assert ns.cached_pages(asked) == [index is not None for index in which]
    assert ns.cached_pages([]) == []
    found = ns.load_pages(asked)
    assert len(opened) == 2 and len(set(opened)) == 2  # one open per extent, not per page
    assert len(found) == len(asked)
    for got, index in zip(found, which, strict=True):
        if index is None:
            assert got is None
            continue
        assert got is not None
        assert all(map(layers_equal, got, stored[index]))
    assert ns.load_pages([]) == []
    assert ns.load_pages([never]) == [None]
    with pytest.raises(InvalidRequestError, match="a page must be 64 tokens"):
        ns.load_pages([pages[0], random_tokens(63)])
    with pytest.raises(InvalidRequestError, match="a page must be 64 tokens"):
        ns.cached_pages([random_tokens(128)])


def prefix_rows(layer: object, page: int) -> object:
    """Page ``page``'s 64 rows of a stored layer (a tensor, or a (k, v) pair)."""
    if isinstance(layer, tuple):
        return layer[0][page * 64 : (page + 1) * 64], layer[1][page * 64 : (page + 1) * 64]
    assert isinstance(layer, torch.Tensor)
    return layer[page * 64 : (page + 1) * 64]


def test_a_damaged_page_in_a_batched_load_misses_alone_and_is_recorded(
    kv: TenantKV, cache_root: Path
) -> None:
    """A page whose bytes fail to open is a miss and one security event; the pages of its
    extent before it that open are served, the other extent's pages too, never wrong bytes."""
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=LAYOUT)
    pages = [random_tokens(64, seed=20 + i) for i in range(5)]
    first, second = random_layers(LAYOUT, 3 * 64, seed=3), random_layers(LAYOUT, 2 * 64, seed=4)
    files_before = {p for p in (cache_root / "blocks").rglob("*") if p.is_file()}
    assert ns.store_pages(pages[:3], first) == 3 * 64
    damaged = {p for p in (cache_root / "blocks").rglob("*") if p.is_file()} - files_before
    assert ns.store_pages(pages[3:], second) == 2 * 64
    (path,) = damaged
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01  # inside the last layer's segment of the batch's last page
    path.write_bytes(bytes(data))
    found = ns.load_pages(pages)
    assert [got is not None for got in found] == [True, True, False, True, True]
    for index in (0, 1, 3, 4):
        layers, offset = (first, index) if index < 3 else (second, index - 3)
        got = found[index]
        assert got is not None
        assert all(map(layers_equal, got, [prefix_rows(layer, offset) for layer in layers]))
    assert kv.security_events().get("segment_open_failed") == 1
    # the damaged extent was dropped: its pages are plain misses now, the others still load
    assert [got is not None for got in ns.load_pages(pages)] == [False, False, False, True, True]
    assert kv.security_events().get("segment_open_failed") == 1
