"""Engine-free parts of the engine integrations: copies between an engine's paged KV and
tenantkv's layers (tenantkv.integrations.paged_kv), and metering a request when it finishes
(Namespace.record_request). The engines' own tests (tests_engines/) use both through vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tenantkv
from tenantkv import KVLayout
from tenantkv.errors import InvalidRequestError
from tenantkv.integrations import paged_kv
from tenantkv.integrations.paged_kv import (
    PagedLayer,
    RequestBlocks,
    gather_layer,
    scatter_layer,
)
from tests.helpers import MHA_SMALL, random_tokens

BLOCK = 16
MHA = KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16)
MLA = KVLayout.mla(num_layers=2, kv_lora_rank=6, rope_dim=2, dtype=torch.bfloat16)
PAGES = KVLayout.mha_pages(2, num_kv_heads=2, head_dim=4, page_tokens=BLOCK, dtype=torch.float16)


def test_mha_pages_round_trip_through_block_ids() -> None:
    pages = torch.zeros(6, 2, BLOCK, 8, dtype=torch.float16)  # [B, H, N, K|V]
    k = torch.randn(2 * BLOCK, 2, 4).half()
    v = torch.randn(2 * BLOCK, 2, 4).half()
    scatter_layer(pages, [4, 1], (k, v), MHA)
    # token t of the layer sits in page block_ids[t // N] at offset t % N, K then V per head
    assert torch.equal(pages[4, 1, 3, :4], k[3, 1]) and torch.equal(pages[4, 1, 3, 4:], v[3, 1])
    assert torch.equal(pages[1, 0, 0, :4], k[BLOCK, 0])
    for untouched in (0, 2, 3, 5):
        assert pages[untouched].abs().sum() == 0
    got_k, got_v = gather_layer(pages, [4, 1], MHA)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_mla_pages_with_and_without_the_head_axis() -> None:
    rows = torch.randn(BLOCK, 8).to(torch.bfloat16)
    four_d = torch.zeros(3, 1, BLOCK, 8, dtype=torch.bfloat16)
    three_d = torch.zeros(3, BLOCK, 8, dtype=torch.bfloat16)  # vLLM's CPU MLA pages
    for pages in (four_d, three_d):
        scatter_layer(pages, [2], rows, MLA)
        assert torch.equal(gather_layer(pages, [2], MLA), rows)
        assert pages[:2].abs().sum() == 0


def test_byte_views_are_read_as_the_layout_dtype() -> None:
    pages = torch.zeros(2, 2, BLOCK, 8, dtype=torch.float16)
    k = torch.randn(BLOCK, 2, 4).half()
    scatter_layer(pages.view(torch.uint8), [1], (k, k), MHA)
    assert torch.equal(pages[1, 0, :, :4], k[:, 0])


def test_mismatched_pages_are_refused_not_copied() -> None:
    wrong_heads = torch.zeros(2, 3, BLOCK, 8, dtype=torch.float16)
    with pytest.raises(InvalidRequestError):
        gather_layer(wrong_heads, [0], MHA)
    with pytest.raises(InvalidRequestError):
        scatter_layer(torch.zeros(2, 2, BLOCK, 8), [0], (torch.zeros(BLOCK, 2, 4),) * 2, MHA)
    pages = torch.zeros(2, 2, BLOCK, 8, dtype=torch.float16)
    too_short = (torch.ones(BLOCK - 1, 2, 4).half(),) * 2
    with pytest.raises(InvalidRequestError):
        scatter_layer(pages, [0], too_short, MHA)
    assert pages.abs().sum() == 0


def test_record_request_meters_hits_and_misses_once(tmp_path: Path, index: object) -> None:
    with tenantkv.open(tmp_path / "cache", durable=False) as kv:
        kv.create_tenant("acme")
        namespace = kv.namespace("acme", model="m", layout=MHA_SMALL)
        tokens = random_tokens(128)
        before = dict(kv.usage("acme").counters)
        for _ in range(3):  # the engines' lookup, asked again and again: not metered
            assert namespace.cached_length(tokens) == 0
        assert kv.usage("acme").counters == before
        namespace.record_request(64, 36)
        after = kv.usage("acme").counters
        assert after["hit_tokens"] - before.get("hit_tokens", 0) == 64
        assert after["miss_tokens"] - before.get("miss_tokens", 0) == 36
        with pytest.raises(InvalidRequestError):
            namespace.record_request(-1, 0)


@st.composite
def _page_choices(draw: st.DrawFn) -> tuple[int, list[int]]:
    """A page count and distinct pages for a layer's blocks: a run of consecutive pages,
    ascending or descending (vLLM hands a new request its free pages in descending order), or
    any order."""
    pages = draw(st.integers(min_value=1, max_value=8))
    count = draw(st.integers(min_value=1, max_value=pages))
    kind = draw(st.sampled_from(["ascending", "descending", "any"]))
    if kind == "any":
        return pages, draw(st.permutations(range(pages)))[:count]
    first = draw(st.integers(min_value=0, max_value=pages - count))
    run = list(range(first, first + count))
    return pages, run if kind == "ascending" else run[::-1]


@settings(max_examples=60, deadline=None)
@given(
    choice=_page_choices(),
    kind=st.sampled_from(["mla", "mha", "mha-pages"]),
    seed=st.integers(0, 2**16),
    max_runs=st.sampled_from([0, paged_kv.MAX_SLICED_RUNS]),
)
def test_scatter_and_gather_match_a_token_by_token_model(
    choice: tuple[int, list[int]], kind: str, seed: int, max_runs: int
) -> None:
    """Both copy paths: slices of consecutive pages, and one indexed copy (``max_runs=0``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_kv, "MAX_SLICED_RUNS", max_runs)
        _scatter_and_gather_match_the_model(choice, kind, seed)


def _scatter_and_gather_match_the_model(
    choice: tuple[int, list[int]], kind: str, seed: int
) -> None:
    num_pages, block_ids = choice
    layout = {"mla": MLA, "mha": MHA, "mha-pages": PAGES}[kind]
    generator = torch.Generator().manual_seed(seed)
    tokens = len(block_ids) * BLOCK
    if kind == "mha-pages":  # a layer is its pages: block i is page block_ids[i] as it is
        pages = torch.zeros(num_pages, 2, BLOCK, 8, dtype=torch.float16)
        layer_pages = torch.randn(len(block_ids), 2, BLOCK, 8, generator=generator).half()
        expected = pages.clone()
        for i, page in enumerate(block_ids):
            expected[page] = layer_pages[i]
        scatter_layer(pages, block_ids, layer_pages, layout)
        assert torch.equal(pages, expected)
        got_pages = gather_layer(pages, block_ids, layout)
        assert isinstance(got_pages, torch.Tensor) and got_pages.is_contiguous()
        assert torch.equal(got_pages, layer_pages)
        return
    if kind == "mla":
        pages = torch.zeros(num_pages, 1, BLOCK, 8, dtype=torch.bfloat16)
        layer: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = torch.randn(
            tokens, 8, generator=generator
        ).to(torch.bfloat16)
    else:
        pages = torch.zeros(num_pages, 2, BLOCK, 8, dtype=torch.float16)
        layer = (
            torch.randn(tokens, 2, 4, generator=generator).half(),
            torch.randn(tokens, 2, 4, generator=generator).half(),
        )
    expected = pages.clone()
    for t in range(tokens):  # the model: one token at a time, by the slot mapping
        page, offset = block_ids[t // BLOCK], t % BLOCK
        if isinstance(layer, torch.Tensor):
            expected[page, 0, offset] = layer[t]
        else:
            for head in range(2):
                expected[page, head, offset] = torch.cat((layer[0][t, head], layer[1][t, head]))
    scatter_layer(pages, block_ids, layer, layout)
    assert torch.equal(pages, expected)  # pages outside block_ids stay zero, as in the model
    got = gather_layer(pages, block_ids, layout)
    if isinstance(layer, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, layer) and got.is_contiguous()
    else:
        assert not isinstance(got, torch.Tensor)
        assert all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(got, layer, strict=True))


def test_a_layer_of_the_wrong_kind_or_dtype_is_refused() -> None:
    pages = torch.zeros(2, 2, BLOCK, 8, dtype=torch.float16)
    k = torch.ones(BLOCK, 2, 4).half()
    with pytest.raises(InvalidRequestError, match="shape"):
        scatter_layer(pages, [0], k, MHA)  # one tensor for a (k, v) layout
    with pytest.raises(InvalidRequestError, match="float32"):
        scatter_layer(pages, [0], (k.float(), k.float()), MHA)
    with pytest.raises(InvalidRequestError, match="shape"):  # as many values, other rows
        scatter_layer(pages, [0], (k.reshape(BLOCK, 4, 2), k.reshape(BLOCK, 4, 2)), MHA)
    assert pages.abs().sum() == 0
    scatter_layer(pages, [0], (k, k), MHA)  # control: the right layer is written
    assert pages[0].abs().sum() > 0


def test_a_requests_blocks_are_worked_out_once_for_every_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Runs of consecutive pages are copied as slices (no index tensor); past
    MAX_SLICED_RUNS runs, one index tensor is built for the request and reused by every
    layer, in both directions."""
    built: list[tuple[int, ...]] = []
    real = paged_kv.block_index

    def counting(block_ids: list[int], device: torch.device) -> torch.Tensor:
        built.append(tuple(block_ids))
        return real(block_ids, device)

    monkeypatch.setattr(paged_kv, "block_index", counting)
    consecutive = RequestBlocks([5, 6, 7, 2, 3])
    assert consecutive.runs == [(5, 3, 0), (2, 2, 3)] and consecutive.sliced
    layers = [PagedLayer(torch.zeros(8, 2, BLOCK, 8, dtype=torch.float16), MHA) for _ in range(4)]
    rows = [(torch.randn(5 * BLOCK, 2, 4).half(), torch.randn(5 * BLOCK, 2, 4).half())] * 4
    for pages, layer in zip(layers, rows, strict=True):
        pages.write(consecutive, layer)
    assert built == []  # slices only
    monkeypatch.setattr(paged_kv, "MAX_SLICED_RUNS", 1)
    scattered = RequestBlocks([5, 6, 7, 2, 3])
    assert not scattered.sliced
    for pages, layer in zip(layers, rows, strict=True):
        pages.write(scattered, layer)
        got = pages.read(scattered)
        assert all(torch.equal(a, b) for a, b in zip(got, layer, strict=True))
    assert built == [(5, 6, 7, 2, 3)]  # once for 4 layers written and read
    assert scattered.index(torch.device("cpu")) is scattered.index(torch.device("cpu"))


def test_slices_while_a_request_has_few_runs_one_indexed_copy_beyond() -> None:
    def runs_of(blocks: int, runs: int) -> RequestBlocks:
        per = blocks // runs  # runs of `per` pages, a page left out between them
        return RequestBlocks([r * (per + 1) + j for r in range(runs) for j in range(per)])

    assert runs_of(8, 4).sliced and not runs_of(8, 8).sliced  # at least 4 runs as slices
    assert runs_of(64, 16).sliced and not runs_of(64, 32).sliced  # blocks // 4
    assert runs_of(256, 16).sliced and not runs_of(256, 32).sliced  # at most 16


def test_pages_are_checked_once_and_bad_blocks_refused_before_any_copy() -> None:
    with pytest.raises(InvalidRequestError, match="does not match the layout"):
        PagedLayer(torch.zeros(2, 3, BLOCK, 8, dtype=torch.float16), MHA)
    with pytest.raises(InvalidRequestError, match=r"KV cache must be a torch\.Tensor"):
        PagedLayer([torch.zeros(2, 2, BLOCK, 8)], MHA)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="repeated"):
        RequestBlocks([1, 2, 1])
    with pytest.raises(InvalidRequestError, match="negative"):
        RequestBlocks([0, -1])
    pages = PagedLayer(torch.zeros(3, 2, BLOCK, 8, dtype=torch.float16), MHA)
    k = torch.ones(2 * BLOCK, 2, 4).half()
    with pytest.raises(InvalidRequestError, match="outside the engine's 3 pages"):
        pages.write(RequestBlocks([2, 3]), (k, k))
    assert pages.pages.abs().sum() == 0  # nothing half-written
    pages.write(RequestBlocks([2, 0]), (k, k))  # control: pages that exist are written
    assert pages.pages[1].abs().sum() == 0 and pages.pages[[0, 2]].abs().sum() > 0


def test_pages_stored_as_pages_are_rows_of_the_pages_and_skip_the_engines_blocks() -> None:
    """``mha-pages``: the pages viewed as rows are the layer's stored rows (a load decrypts into
    them); a write that skips the blocks the engine has writes the rest; a page of another
    size, or a layer that is not whole pages, is refused."""
    pages = torch.zeros(6, 2, BLOCK, 8, dtype=torch.float16)
    paged = PagedLayer(pages, PAGES)
    assert paged.rows is not None and paged.rows.shape == (6 * BLOCK, PAGES.values_per_token)
    assert paged.rows.data_ptr() == pages.data_ptr()
    layer = torch.randn(3, 2, BLOCK, 8).half()
    blocks = RequestBlocks([4, 1])
    paged.write(blocks, layer, skip_blocks=1)  # the engine has block 0 of the request
    assert torch.equal(pages[4], layer[1]) and torch.equal(pages[1], layer[2])
    assert pages[[0, 2, 3, 5]].abs().sum() == 0
    # block i of the layout's rows is page i's bytes, in the page's own order
    assert torch.equal(paged.rows[4 * BLOCK : 5 * BLOCK].reshape(-1), layer[1].reshape(-1))
    mha = PagedLayer(torch.zeros(6, 2, BLOCK, 8, dtype=torch.float16), MHA)
    assert mha.rows is None  # control: a token's k || v row is not contiguous in MHA pages
    with pytest.raises(InvalidRequestError, match="does not match the layout"):
        PagedLayer(torch.zeros(6, 2, 2 * BLOCK, 8, dtype=torch.float16), PAGES)
    with pytest.raises(InvalidRequestError, match="does not fill these pages"):
        paged.write(RequestBlocks([0]), layer)  # three pages for one
    assert pages[0].abs().sum() == 0


def test_a_view_over_the_same_pages_is_recognised() -> None:
    """vLLM's MLA layers keep a squeezed view of the registered pages: the same memory and
    shape is the same view, another shape or memory is checked again."""
    registered = torch.zeros(4, 1, BLOCK, 8, dtype=torch.bfloat16)
    paged = PagedLayer(registered, MLA)
    assert paged.same_pages(registered)
    assert not paged.same_pages(registered.squeeze(1))
    assert not paged.same_pages(registered.clone())
    assert PagedLayer(registered.squeeze(1), MLA).same_pages(registered.squeeze(1))
