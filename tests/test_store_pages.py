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
