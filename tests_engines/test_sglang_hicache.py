"""The SGLang HiCache backend through SGLang's own classes: ``StorageBackendFactory`` builds it
from a ``dynamic`` config (``cls(storage_config, kwargs)``) with a real ``HiCacheStorageConfig``.

SGLang's host pools (``MHATokenToKVPoolHost``) cannot be imported here: their module pulls in
torchvision, whose PyPI build breaks beside the CPU torch. ``PageFirstHostPool`` stands in for
one, with the same page API (``page_size``, ``get_data_page``, ``set_from_flat_data_page``,
``get_dummy_flat_data_page``) and the same page-first buffer shape.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

import tenantkv
from tenantkv.errors import InvalidRequestError
from tenantkv.integrations.engine_identity import ASSERTION_REFUSED, ENGINE_ERRORS
from tenantkv.integrations.sglang import TenantKVHiCacheStorage, _adjacent
from tenantkv.tenant_assertion import AssertionSigner
from tests.indexes import Index

pytestmark = pytest.mark.usefixtures("no_leftover_caches")

PAGE, LAYERS, HEADS, DIM = 16, 2, 2, 8


class PageFirstHostPool:
    """SGLang's MHA host pool page API over a page-first buffer [2, size, layers, heads, dim]."""

    def __init__(self, pages: int) -> None:
        self.page_size = PAGE
        self.layout = "page_first"
        self.dtype = torch.float16
        self.kv_buffer = torch.zeros(2, pages * PAGE, LAYERS, HEADS, DIM, dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index : index + PAGE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * PAGE * LAYERS * HEADS * DIM, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index : index + PAGE] = data_page.reshape(2, PAGE, LAYERS, HEADS, DIM)


class SizedHostPool(PageFirstHostPool):
    """An MHA page-first host pool that also says its sizes, under the names SGLang's
    ``MHATokenToKVPoolHost`` gives them (``head_num``, ``head_dim``, ``layer_num``)."""

    def __init__(self, pages: int, heads: int = 2, dim: int = 64) -> None:
        self.page_size = PAGE
        self.layout = "page_first"
        self.dtype = torch.float16
        self.layer_num, self.head_num, self.head_dim = LAYERS, heads, dim
        self.kv_buffer = torch.zeros(2, pages * PAGE, LAYERS, heads, dim, dtype=self.dtype)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * PAGE * LAYERS * self.head_num * self.head_dim, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        shape = (2, PAGE, LAYERS, self.head_num, self.head_dim)
        self.kv_buffer[:, index : index + PAGE] = data_page.reshape(shape)


class MLAHostPool:
    """SGLang's MLA host pool page API (``MLATokenToKVPoolHost``, page-first layout) over a
    buffer [size, layers, 1, kv_lora_rank + qk_rope_head_dim], with its sizes' names."""

    kv_lora_rank, qk_rope_head_dim = 512, 64

    def __init__(self, pages: int) -> None:
        self.page_size = PAGE
        self.layout = "page_first"
        self.dtype = torch.bfloat16
        self.layer_num = LAYERS
        self.kv_cache_dim = self.kv_lora_rank + self.qk_rope_head_dim
        self.kv_buffer = torch.zeros(pages * PAGE, LAYERS, 1, self.kv_cache_dim, dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[index : index + PAGE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(PAGE * LAYERS * self.kv_cache_dim, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        shape = (PAGE, LAYERS, 1, self.kv_cache_dim)
        self.kv_buffer[index : index + PAGE] = data_page.reshape(shape)


def backend(
    root: Path,
    index: Index,
    pem: str,
    assertion: str | None,
    host: Any,
    codec: str | None = None,
    *,
    mla: bool = False,
    extra_config: dict[str, Any] | None = None,
) -> HiCacheStorage:
    extra: dict[str, Any] = {
        "backend_name": "tenantkv",
        "module_path": "tenantkv.integrations.sglang",
        "class_name": "TenantKVHiCacheStorage",
        "root": str(root),
        "open_options": {"database_url": index.url(root), "durable": False},
        "gateway_public_keys": [pem],
        "model": "tiny",
    }
    if assertion is not None:
        extra["tenantkv_assertion"] = assertion
    if codec is not None:
        extra["codec"] = codec
    extra.update(extra_config or {})
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="tiny",
        extra_config=extra,
    )
    storage = StorageBackendFactory.create_backend("dynamic", config, host)
    assert isinstance(storage, TenantKVHiCacheStorage)
    storage.register_mem_pool_host(host)
    return storage


@pytest.fixture
def root(tmp_path: Path, index: Index) -> Path:
    root = tmp_path / "cache"
    with tenantkv.open(root, durable=False) as kv:
        kv.create_tenant("acme")
        kv.create_tenant("globex")
    return root


def filled_pool(pages: int, seed: int) -> PageFirstHostPool:
    host = PageFirstHostPool(pages)
    generator = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=generator).half())
    return host


KEYS = ["page-hash-0", "page-hash-1", "page-hash-2"]


def test_round_trip_through_host_pool_indices(
    root: Path, index: Index, gateway: AssertionSigner, gateway_pem: str
) -> None:
    source = filled_pool(4, seed=1)
    writer = backend(root, index, gateway_pem, gateway.sign("acme", ttl=240), source)
    indices = torch.arange(0, 3 * PAGE)  # token slots of pages 0, 1, 2
    assert writer.batch_set_v1(KEYS, indices) == [True, True, True]
    assert writer.batch_exists([*KEYS, "never-stored"]) == 3
    target = PageFirstHostPool(4)
    reader = backend(root, index, gateway_pem, gateway.sign("acme", ttl=240), target)
    into = torch.arange(PAGE, 4 * PAGE)  # into pages 1, 2, 3 of another pool
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert reader.batch_get_v1(KEYS, into, info) == [True, True, True]
    assert torch.equal(target.kv_buffer[:, PAGE:], source.kv_buffer[:, : 3 * PAGE])
    assert target.kv_buffer[:, :PAGE].abs().sum() == 0  # page 0 untouched
    # the older single-page interface
    page = reader.get(
        KEYS[1], torch.empty(source.get_dummy_flat_data_page().shape, dtype=torch.float16)
    )
    assert page is not None and torch.equal(page, source.get_data_page(PAGE))
    assert reader.exists(KEYS[0]) and not reader.exists("never-stored")


def test_isolation_by_assertion(
    root: Path,
    index: Index,
    gateway: AssertionSigner,
    gateway_key: Ed25519PrivateKey,
    gateway_pem: str,
) -> None:
    source = filled_pool(4, seed=2)
    owner = backend(root, index, gateway_pem, gateway.sign("acme", ttl=240), source)
    assert all(owner.batch_set_v1(KEYS, torch.arange(0, 3 * PAGE)))
    stale = AssertionSigner(gateway_key, clock=lambda: time.time() - 600).sign("acme", ttl=60)
    rogue = AssertionSigner(Ed25519PrivateKey.generate()).sign("acme", ttl=240)
    others = {
        "globex": gateway.sign("globex", ttl=240),
        "acme-scope": gateway.sign("acme", scope="u2", ttl=240),
        "expired": stale,
        "forged": rogue,
        "unsigned": None,
    }
    for name, assertion in others.items():
        target = PageFirstHostPool(4)
        other = backend(root, index, gateway_pem, assertion, target)
        assert other.batch_exists(KEYS) == 0, name
        assert other.batch_get_v1(KEYS, torch.arange(0, 3 * PAGE)) == [False] * 3, name
        assert target.kv_buffer.abs().sum() == 0, name
        if name in ("expired", "forged", "unsigned"):
            assert other.batch_set_v1(KEYS, torch.arange(0, 3 * PAGE)) == [False] * 3
    kv = owner._kv
    assert kv.security_events()[ASSERTION_REFUSED] == 3  # once per refused assertion
    # the positive control: the owner, with a fresh assertion, still reads every page
    target = PageFirstHostPool(4)
    again = backend(root, index, gateway_pem, gateway.sign("acme", ttl=240), target)
    assert again.batch_get_v1(KEYS, torch.arange(0, 3 * PAGE)) == [True] * 3
    assert torch.equal(target.kv_buffer[:, : 3 * PAGE], source.kv_buffer[:, : 3 * PAGE])
    # a per-call assertion (SGLang's extra_info) takes precedence over the deployment's
    call = HiCacheStorageExtraInfo(extra_info={"tenantkv_assertion": gateway.sign("globex")})
    assert again.batch_get_v1(KEYS, torch.arange(0, 3 * PAGE), call) == [False] * 3


def test_damaged_page_is_a_miss_and_a_security_event(
    root: Path, index: Index, gateway: AssertionSigner, gateway_pem: str
) -> None:
    source = filled_pool(4, seed=3)
    storage = backend(root, index, gateway_pem, gateway.sign("acme", ttl=240), source)
    assert all(storage.batch_set_v1(KEYS, torch.arange(0, 3 * PAGE)))
    files = sorted(p for p in (root / "blocks").rglob("*") if p.is_file())
    assert len(files) == 1  # one extent for the batch of 3 pages
    damaged = files[0]
    data = bytearray(damaged.read_bytes())
    data[-10] ^= 0x01  # inside the last page's segment
    damaged.write_bytes(bytes(data))
    source.kv_buffer.zero_()
    result = storage.batch_get_v1(KEYS, torch.arange(0, 3 * PAGE))
    assert result == [True, True, False]  # the pages before it opened; the damaged one missed
    assert storage._kv.security_events().get("segment_open_failed") == 1
    # its page in the pool was left as it was (zeros), not filled; the others were
    assert source.kv_buffer[:, 2 * PAGE : 3 * PAGE].abs().sum() == 0
    assert all(source.kv_buffer[:, i * PAGE : (i + 1) * PAGE].abs().sum() > 0 for i in range(2))
    # the damaged extent was dropped with its batch: plain misses now, never wrong data, and
    # the pages can be stored again
    assert storage.batch_exists(KEYS) == 0
    refill = filled_pool(4, seed=3)
    storage.mem_pool_host = refill
    assert storage.batch_set_v1(KEYS, torch.arange(0, 3 * PAGE)) == [True] * 3
    assert storage.batch_exists(KEYS) == 3


def test_a_cache_error_is_a_counted_miss(
    root: Path, index: Index, gateway: AssertionSigner, gateway_pem: str
) -> None:
    source = filled_pool(4, seed=4)
    storage = backend(root, index, gateway_pem, gateway.sign("acme", ttl=240), source)
    health = storage._kv.context.health
    before = health.counts().get(ENGINE_ERRORS, 0)
    odd = torch.ones(17, dtype=torch.float16)  # a page tenantkv cannot key (not 16 rows)
    assert storage.set("odd-page", odd) is False
    assert storage.get("odd-page", torch.empty_like(odd)) is None
    assert health.counts()[ENGINE_ERRORS] == before + 2  # each a miss, and counted
    # positive control: a well-shaped page is stored and read back
    page = source.get_data_page(0)
    assert storage.set("good-page", page) is True
    assert torch.equal(storage.get("good-page", torch.empty_like(page)), page)
    assert health.counts()[ENGINE_ERRORS] == before + 2


def test_a_coded_backend_round_trips_pages_close_to_what_was_stored(
    root: Path, index: Index, gateway: AssertionSigner, gateway_pem: str
) -> None:
    """``codec`` in the extra config stores pages coded: they come back close to (never equal
    to) the stored pages; a backend without the codec is another namespace and misses."""
    codec = "fp8"
    source = filled_pool(4, seed=2)
    token = gateway.sign("acme", ttl=240)
    writer = backend(root, index, gateway_pem, token, source, codec=codec)
    assert writer.batch_set_v1(KEYS, torch.arange(0, 3 * PAGE)) == [True, True, True]
    target = PageFirstHostPool(4)
    reader = backend(root, index, gateway_pem, token, target, codec=codec)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert reader.batch_get_v1(KEYS, torch.arange(PAGE, 4 * PAGE), info) == [True] * 3
    got, want = target.kv_buffer[:, PAGE:].float(), source.kv_buffer[:, : 3 * PAGE].float()
    error = float((got - want).norm() / want.norm())
    assert 0 < error < 0.05
    plain = backend(root, index, gateway_pem, token, PageFirstHostPool(4))
    assert plain.batch_exists(KEYS) == 0
    # int4 needs the page's vectors, which this stand-in pool does not say (see below)
    with pytest.raises(InvalidRequestError, match="int4"):
        backend(root, index, gateway_pem, token, PageFirstHostPool(4), codec="int4")
    with pytest.raises(InvalidRequestError, match="unknown codec"):
        backend(root, index, gateway_pem, token, PageFirstHostPool(4), codec="nf4")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def extent_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "blocks").rglob("*") if p.is_file())


#: The int4 error bounds these tests hold pages to (relative L2 error over the pages; measured
#: on these seeds and shapes: MHA 0.097, MLA c_KV 0.078 with outlier channels, k_rot 0.026 at
#: fp8).
INT4_BOUND, FP8_BOUND = 0.12, 0.04


def test_int4_mha_pages_round_trip_as_head_vectors(
    root: Path, index: Index, gateway: AssertionSigner, gateway_pem: str
) -> None:
    """With the pool's ``head_dim``, int4 codes each head vector (rotated and scaled in groups
    of 32): pages come back within the measured error, in fewer than a third of the bytes, by
    ``batch_get_v1``, ``batch_get`` and ``get`` alike; another codec's backend misses."""
    token = gateway.sign("acme", ttl=240)
    source = SizedHostPool(4)
    generator = torch.Generator().manual_seed(5)
    source.kv_buffer.copy_(torch.randn(source.kv_buffer.shape, generator=generator).half())
    writer = backend(root, index, gateway_pem, token, source, codec="int4")
    before = extent_bytes(root)
    assert writer.batch_set_v1(KEYS, torch.arange(0, 3 * PAGE)) == [True] * 3
    stored = extent_bytes(root) - before
    assert stored < 0.3 * 3 * source.get_data_page(0).numel() * 2  # fp16: 2 B a value
    target = SizedHostPool(4)
    reader = backend(root, index, gateway_pem, token, target, codec="int4")
    assert reader.batch_get_v1(KEYS, torch.arange(PAGE, 4 * PAGE)) == [True] * 3
    want = source.kv_buffer[:, : 3 * PAGE]
    error = relative_error(target.kv_buffer[:, PAGE:], want)
    print(f"int4 MHA pages: relative error {error:.4f}, {stored} B stored")  # shown with -s
    assert 0 < error < INT4_BOUND
    assert target.kv_buffer[:, :PAGE].abs().sum() == 0  # page 0 untouched
    # the flat-page interfaces give the same decoded values
    pages = reader.batch_get([KEYS[2], "never-stored", KEYS[0]])
    assert pages[1] is None and pages[0] is not None and pages[2] is not None
    assert torch.equal(pages[0], target.get_data_page(3 * PAGE))
    assert torch.equal(pages[2], target.get_data_page(PAGE))
    one = reader.get(KEYS[1], torch.empty_like(target.get_dummy_flat_data_page()))
    assert one is not None and torch.equal(one, target.get_data_page(2 * PAGE))
    # batch_exists counts from the first page to the first miss (one index read)
    assert reader.batch_exists([KEYS[0], "never-stored", KEYS[1]]) == 1
    assert reader.batch_exists(KEYS) == 3 and reader.batch_exists([]) == 0
    plain = backend(root, index, gateway_pem, token, SizedHostPool(4))
    assert plain.batch_exists(KEYS) == 0  # codec none: another namespace


def test_int4_mla_pages_keep_k_rot_at_fp8(
    root: Path, index: Index, gateway: AssertionSigner, gateway_pem: str
) -> None:
    """With ``is_mla_model`` and the pool's ``kv_lora_rank`` / ``qk_rope_head_dim``, int4 codes
    each token's ``c_KV`` (with outlier channels, which the rotation spreads) and keeps its
    ``k_rot`` at fp8, as the in-process codec does: each part's error is measured on its own."""
    token = gateway.sign("acme", ttl=240)
    source = MLAHostPool(4)
    generator = torch.Generator().manual_seed(6)
    values = torch.randn(source.kv_buffer.shape, generator=generator)
    values[..., :8] *= 40.0  # heavy-tailed: eight outlier channels of c_KV
    source.kv_buffer.copy_(values.to(torch.bfloat16))
    writer = backend(root, index, gateway_pem, token, source, codec="int4", mla=True)
    before = extent_bytes(root)
    assert writer.batch_set_v1(KEYS, torch.arange(0, 3 * PAGE)) == [True] * 3
    stored = extent_bytes(root) - before
    page_bytes = 3 * source.get_data_page(0).numel() * 2  # bf16
    assert stored < 0.32 * page_bytes  # 352 of 1,152 B a token and layer, and the headers
    target = MLAHostPool(4)
    reader = backend(root, index, gateway_pem, token, target, codec="int4", mla=True)
    assert reader.batch_get_v1(KEYS, torch.arange(PAGE, 4 * PAGE)) == [True] * 3
    got, want = target.kv_buffer[PAGE:], source.kv_buffer[: 3 * PAGE]
    rank = MLAHostPool.kv_lora_rank
    latent = relative_error(got[..., :rank], want[..., :rank])
    rope = relative_error(got[..., rank:], want[..., rank:])
    print(f"int4 MLA pages: c_KV {latent:.4f}, k_rot {rope:.4f}, {stored} B")  # shown with -s
    assert 0 < latent < INT4_BOUND
    assert 0 < rope < FP8_BOUND  # fp8, not int4
    one = reader.get(KEYS[2], torch.empty_like(target.get_dummy_flat_data_page()))
    assert one is not None and torch.equal(one, target.get_data_page(3 * PAGE))


def test_int4_refuses_pages_that_are_not_whole_rows_of_vectors(
    root: Path, index: Index, gateway: AssertionSigner, gateway_pem: str
) -> None:
    """A page that is not 16 rows of whole vectors is refused when the pool is registered (at
    SGLang's start), with a sentence; the extra config's sizes take precedence over the pool's."""
    token = gateway.sign("acme", ttl=240)
    with pytest.raises(InvalidRequestError, match="not a multiple of 32 vectors of 48"):
        backend(
            root,
            index,
            gateway_pem,
            token,
            SizedHostPool(4),
            codec="int4",
            extra_config={"head_dim": 48},
        )
    with pytest.raises(InvalidRequestError, match="kv_lora_rank and qk_rope_head_dim"):
        backend(root, index, gateway_pem, token, SizedHostPool(4), codec="int4", mla=True)
    with pytest.raises(InvalidRequestError, match="head_dim must be a positive integer"):
        backend(root, index, gateway_pem, token, SizedHostPool(4), extra_config={"head_dim": "64"})
    # positive control: the pool's own sizes fit
    assert isinstance(
        backend(root, index, gateway_pem, token, SizedHostPool(4), codec="int4"),
        TenantKVHiCacheStorage,
    )


def test_adjacent_pages_are_sealed_from_the_pool_and_others_copied(
    root: Path, index: Index, gateway: AssertionSigner, gateway_pem: str
) -> None:
    """Consecutive pages of a page-first MLA pool lie one after the other: a batch of them is
    sealed from one view of the pool (no copy); pages elsewhere (out of order, or not adjacent)
    are copied into one tensor first. Both come back byte for byte."""
    token = gateway.sign("acme", ttl=240)
    source = MLAHostPool(4)
    source.kv_buffer.view(torch.int16).copy_(
        torch.randint(-(1 << 15), 1 << 15, source.kv_buffer.shape, dtype=torch.int16)
    )
    pages = [source.get_data_page(i * PAGE) for i in range(3)]
    joined = _adjacent(pages)
    assert joined is not None and joined.data_ptr() == pages[0].data_ptr()  # a view
    assert _adjacent([pages[1], pages[0]]) is None
    assert _adjacent([pages[0], pages[2]]) is None
    # separate storages are never one view, even should the allocator place them side by side
    assert _adjacent([torch.zeros(PAGE), torch.zeros(PAGE)]) is None
    storage = backend(root, index, gateway_pem, token, source, mla=True)
    assert storage.batch_set_v1(KEYS, torch.arange(0, 3 * PAGE)) == [True] * 3
    assert storage.batch_set_v1(["b", "a"], torch.tensor([*range(PAGE, 2 * PAGE), *range(PAGE)]))
    target = MLAHostPool(4)
    reader = backend(root, index, gateway_pem, token, target, mla=True)
    assert reader.batch_get_v1([*KEYS, "a"], torch.arange(0, 4 * PAGE)) == [True] * 4
    want = source.kv_buffer[: 3 * PAGE].view(torch.int16)
    assert torch.equal(target.kv_buffer[: 3 * PAGE].view(torch.int16), want)
    assert torch.equal(
        target.kv_buffer[3 * PAGE :].view(torch.int16), source.kv_buffer[:PAGE].view(torch.int16)
    )
