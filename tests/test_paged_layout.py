"""The ``mha-pages`` layout kind: MHA/GQA values kept as an engine pages them (vLLM's CPU
backend, ``[P, H, N, 2 * D]``), stored as the pages' bytes so that a load decrypts straight
into an engine's pages. Its own namespaces, whole pages only, no edits; codecs code it."""

from __future__ import annotations

import pytest
import torch

from tenantkv import InvalidRequestError, KVLayout, TenantKV
from tenantkv.editing import EditScript, RopeSpec
from tenantkv.integrations.paged_kv import PagedLayer, RequestBlocks
from tenantkv.services.editing import edit_cached_prefix
from tests.helpers import layers_equal, load_all, random_layers, random_tokens

PAGE = 16
PAGES = KVLayout.mha_pages(2, num_kv_heads=2, head_dim=8, page_tokens=PAGE, dtype=torch.float16)
MHA = KVLayout.mha(2, num_kv_heads=2, head_dim=8, dtype=torch.float16)


@pytest.fixture
def tenants(kv: TenantKV) -> TenantKV:
    kv.create_tenant("acme")
    kv.create_tenant("globex")
    return kv


def test_pages_round_trip_and_stay_the_owners(tenants: TenantKV) -> None:
    tokens = random_tokens(128)
    layers = random_layers(PAGES, 128, seed=4)
    ns = tenants.namespace("acme", model="m", layout=PAGES, block_tokens=32)
    assert ns.store(tokens, layers) == 128
    got = load_all(ns, tokens)
    assert all(layers_equal(a, b) for a, b in zip(got, layers, strict=True))
    assert all(isinstance(layer, torch.Tensor) and layer.shape == (8, 2, PAGE, 16) for layer in got)
    # another tenant's namespace of the same layout misses; the owner's hits (above)
    assert tenants.namespace("globex", model="m", layout=PAGES, block_tokens=32).lookup(tokens) == 0
    # token rows of the same shape are another kind: another namespace, no hit
    assert tenants.namespace("acme", model="m", layout=MHA, block_tokens=32).lookup(tokens) == 0
    # so is another page size (its bytes mean other tokens)
    other_pages = KVLayout.mha_pages(2, 2, 8, page_tokens=32, dtype=torch.float16)
    assert (
        tenants.namespace("acme", model="m", layout=other_pages, block_tokens=32).lookup(tokens)
        == 0
    )
    assert ns.lookup(tokens) == 128


def test_a_load_decrypts_into_an_engines_pages(tenants: TenantKV) -> None:
    """The pages viewed as rows take the load (``block_rows``: each block's first row, a block
    being one page, as vLLM's connector has them), with every page outside the request's left
    as it was."""
    tokens = random_tokens(64, seed=2)
    source = torch.randn(5, 2, PAGE, 16).half()  # an engine's pages, the request's in 3, 0, 4, 1
    blocks = RequestBlocks([3, 0, 4, 1])
    ns = tenants.namespace("acme", model="m", layout=PAGES, block_tokens=PAGE)
    layers = [PagedLayer(source, PAGES).read(blocks)] * 2
    assert ns.store(tokens, layers) == 64
    targets = [
        PagedLayer(torch.zeros(6, 2, PAGE, 16, dtype=torch.float16), PAGES) for _ in range(2)
    ]
    rows = [target.rows for target in targets]
    assert all(r is not None for r in rows)
    with ns.load(tokens, "cpu", out=rows, block_rows=blocks.first_rows(PAGE)) as stream:
        assert [index for index, _ in stream] == [0, 1]
    for target in targets:
        assert torch.equal(target.pages[[3, 0, 4, 1]], source[[3, 0, 4, 1]])
        assert target.pages[[2, 5]].abs().sum() == 0


def test_blocks_and_layers_must_be_whole_pages(tenants: TenantKV) -> None:
    with pytest.raises(InvalidRequestError, match="not whole pages of 32 tokens"):
        tenants.namespace(
            "acme",
            model="m",
            layout=KVLayout.mha_pages(2, 2, 8, 32, torch.float16),
            block_tokens=48,
        )
    ns = tenants.namespace("acme", model="m", layout=PAGES, block_tokens=32)
    tokens = random_tokens(72)  # 4.5 pages
    with pytest.raises(InvalidRequestError, match="not whole pages of 16"):
        ns.store(tokens, random_layers(PAGES, 64))
    wrong = [torch.zeros(4, 2, 8, 32, dtype=torch.float16)] * 2  # tokens and values swapped
    with pytest.raises(InvalidRequestError, match="shape"):
        ns.store(tokens[:64], wrong)
    assert ns.lookup(tokens[:64]) == 0
    assert ns.store(tokens[:64], random_layers(PAGES, 64)) == 64  # control: whole pages store
    with pytest.raises(InvalidRequestError, match="page_tokens must be a positive integer"):
        KVLayout.mha_pages(2, 2, 8, 0, torch.float16)


def test_pages_are_not_edited(tenants: TenantKV) -> None:
    """A row of pages is not a token, so an edit (dropping tokens, moving keys) is refused
    rather than run on the wrong values."""
    tokens = random_tokens(128, seed=5)
    ns = tenants.namespace("acme", model="m", layout=PAGES, block_tokens=32)
    assert ns.store(tokens, random_layers(PAGES, 128)) == 128
    rope = RopeSpec.standard(10000.0, 8, "half")
    with pytest.raises(InvalidRequestError, match="cannot be edited"):
        edit_cached_prefix(ns, tokens, EditScript.dropping([(40, 60)]), rope)
    assert ns.lookup(tokens) == 128  # the prefix itself is untouched


@pytest.mark.parametrize("codec", ["fp8", "int4"])
def test_codecs_code_pages(tenants: TenantKV, codec: str) -> None:
    tokens = random_tokens(64, seed=6)
    layers = random_layers(PAGES, 64, seed=7)
    ns = tenants.namespace("acme", model="m", layout=PAGES, block_tokens=32, codec=codec)
    assert ns.store(tokens, layers) == 64
    for got, want in zip(load_all(ns, tokens), layers, strict=True):
        assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
        assert got.shape == want.shape
        error = (got.float() - want.float()).abs().max().item()
        assert 0 < error < (0.2 if codec == "fp8" else 1.0)  # lossy, and close
