"""Bad input: every malformed call raises a clear, typed error and changes nothing.

"Changes nothing" is checked on ``kv.info()`` counts and on the files under the root's
``blocks/`` directory (extents and temporaries), with the valid version of the same call as the
positive control that does change them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

import tenantkv
from tenantkv import BLOCK_TOKENS, KVLayout, Namespace, TenantKV

from .helpers import MHA_SMALL, MLA_SMALL, load_all, random_layers, random_tokens

Snapshot = tuple[dict[str, int], dict[str, str]]

_COUNTED = ("tenants", "namespaces", "extents", "blocks", "cached_tokens", "stored_bytes")


def snapshot(kv: TenantKV) -> Snapshot:
    """Index counts from ``kv.info()`` and the content hash of every file under ``blocks/``."""
    info = kv.info()
    counts = {name: int(info[name]) for name in _COUNTED}
    blocks = Path(kv.config.root) / "blocks"
    files = {
        str(path.relative_to(blocks)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(blocks.rglob("*"))
        if path.is_file()
    }
    return counts, files


def extent_files(state: Snapshot) -> set[str]:
    return {name for name in state[1] if name.startswith("extents/")}


@pytest.fixture
def mla(kv: TenantKV) -> Namespace:
    kv.create_tenant("acme")
    return kv.namespace("acme", model="bad-input", layout=MLA_SMALL)


@pytest.fixture
def mha(kv: TenantKV) -> Namespace:
    kv.create_tenant("globex")
    return kv.namespace("globex", model="bad-input", layout=MHA_SMALL)


def assert_valid_store_changes_state(kv: TenantKV, ns: Namespace, tokens: list[int]) -> None:
    """Positive control: the valid store of the same tokens adds an extent, blocks and a file."""
    before = snapshot(kv)
    stored = ns.store(tokens, random_layers(ns.layout, len(tokens), seed=7))
    after = snapshot(kv)
    assert stored == (len(tokens) // BLOCK_TOKENS) * BLOCK_TOKENS > 0
    assert after[0]["extents"] == before[0]["extents"] + 1
    assert after[0]["blocks"] == before[0]["blocks"] + len(tokens) // BLOCK_TOKENS
    assert len(extent_files(after)) == len(extent_files(before)) + 1
    assert ns.lookup(tokens) == stored


def check_rejected_store(
    kv: TenantKV,
    ns: Namespace,
    tokens: Any,
    layers: Any,
    match: str,
    valid_tokens: list[int],
) -> None:
    """The store raises InvalidRequestError naming the problem, and nothing changed."""
    before = snapshot(kv)
    with pytest.raises(tenantkv.InvalidRequestError, match=match) as caught:
        ns.store(tokens, layers)
    assert isinstance(caught.value, ValueError)
    assert snapshot(kv) == before, "a rejected store changed the cache"
    assert ns.lookup(valid_tokens) == 0
    assert_valid_store_changes_state(kv, ns, valid_tokens)


# ---- layers -------------------------------------------------------------------------------------

LayersCase = Callable[[KVLayout, int], Any]


def _mla_layers(layout: KVLayout, n: int) -> list[Any]:
    return list(random_layers(layout, n, seed=1))


def _replace(layers: list[Any], index: int, value: Any) -> list[Any]:
    out = list(layers)
    out[index] = value
    return out


MLA_BAD_LAYERS: dict[str, tuple[LayersCase, str]] = {
    "too-few-layers": (lambda lay, n: _mla_layers(lay, n)[:-1], r"got 2 layers.*has 3"),
    "too-many-layers": (
        lambda lay, n: _mla_layers(lay, n) + _mla_layers(lay, n)[:1],
        r"got 4 layers.*has 3",
    ),
    "no-layers": (lambda lay, n: [], r"got 0 layers"),
    "wrong-width": (
        lambda lay, n: _replace(_mla_layers(lay, n), 1, torch.zeros(n, 39, dtype=lay.dtype)),
        r"layer 1 has shape \[128, 39\].*\[128, 40\]",
    ),
    "extra-dim": (
        lambda lay, n: _replace(_mla_layers(lay, n), 0, torch.zeros(n, 1, 40, dtype=lay.dtype)),
        r"layer 0 has shape",
    ),
    "wrong-dtype": (
        lambda lay, n: _replace(_mla_layers(lay, n), 2, _mla_layers(lay, n)[2].float()),
        r"layer 2 has dtype torch.float32.*bfloat16",
    ),
    "wrong-dtype-int": (
        lambda lay, n: _replace(_mla_layers(lay, n), 0, torch.zeros(n, 40, dtype=torch.int16)),
        r"layer 0 has dtype torch.int16",
    ),
    "pair-instead-of-tensor": (
        lambda lay, n: _replace(_mla_layers(lay, n), 0, (torch.zeros(n, 40), torch.zeros(n, 40))),
        r"layer 0 must be a torch.Tensor",
    ),
    "numpy-layer": (
        lambda lay, n: _replace(_mla_layers(lay, n), 1, np.zeros((n, 40), dtype=np.float32)),
        r"layer 1 must be a torch.Tensor",
    ),
    "layers-one-tensor": (
        lambda lay, n: torch.stack(_mla_layers(lay, n)),
        r"layers must be a sequence of 3",
    ),
    "layers-none": (lambda lay, n: None, r"layers must be a sequence"),
    "layers-generator": (lambda lay, n: iter(_mla_layers(lay, n)), r"layers must be a sequence"),
    "fewer-rows-than-tokens": (
        lambda lay, n: _mla_layers(lay, n - BLOCK_TOKENS),
        r"layer 0 has shape \[64, 40\].*\[128, 40\]",
    ),
    "more-rows-than-tokens": (
        lambda lay, n: _mla_layers(lay, n + 1),
        r"layer 0 has shape \[129, 40\].*\[128, 40\]",
    ),
    "last-layer-short": (
        lambda lay, n: _replace(_mla_layers(lay, n), 2, _mla_layers(lay, n)[2][:-1]),
        r"layer 2 has shape \[127, 40\]",
    ),
    # Tensors without ordinary memory: PyTorch's own errors would escape from deep inside.
    "meta-layer": (
        lambda lay, n: _replace(
            _mla_layers(lay, n), 1, torch.empty(n, 40, dtype=lay.dtype, device="meta")
        ),
        r"layer 1 is on the meta device",
    ),
    "sparse-coo-layer": (
        lambda lay, n: _replace(_mla_layers(lay, n), 2, _mla_layers(lay, n)[2].to_sparse()),
        r"layer 2 has layout torch.sparse_coo",
    ),
    "sparse-csr-layer": (
        lambda lay, n: _replace(
            _mla_layers(lay, n), 0, _mla_layers(lay, n)[0].float().to_sparse_csr().to(lay.dtype)
        ),
        r"layer 0 has layout torch.sparse_csr",
    ),
    "nested-layer": (
        lambda lay, n: _replace(
            _mla_layers(lay, n),
            1,
            torch.nested.nested_tensor(list(_mla_layers(lay, n)[1].split(64)), layout=torch.jagged),
        ),
        r"layer 1 is a nested tensor",
    ),
}


@pytest.mark.parametrize("case", sorted(MLA_BAD_LAYERS))
def test_mla_bad_layers_rejected(kv: TenantKV, mla: Namespace, case: str) -> None:
    make, match = MLA_BAD_LAYERS[case]
    tokens = random_tokens(128, seed=11)
    check_rejected_store(kv, mla, tokens, make(MLA_SMALL, 128), match, tokens)


def _mha_layers(layout: KVLayout, n: int) -> list[Any]:
    return list(random_layers(layout, n, seed=2))


def _kv_shape(n: int) -> tuple[int, int, int]:
    return (n, MHA_SMALL.num_kv_heads, MHA_SMALL.head_dim)


MHA_BAD_LAYERS: dict[str, tuple[LayersCase, str]] = {
    "too-few-layers": (lambda lay, n: _mha_layers(lay, n)[:1], r"got 1 layers.*has 2"),
    "layer-is-tensor": (
        lambda lay, n: _replace(_mha_layers(lay, n), 0, torch.stack(_mha_layers(lay, n)[0])),
        r"layer 0 must be a \(k, v\) pair",
    ),
    "layer-is-single": (
        lambda lay, n: _replace(_mha_layers(lay, n), 1, (_mha_layers(lay, n)[1][0],)),
        r"layer 1 must be a \(k, v\) pair",
    ),
    "layer-is-triple": (
        lambda lay, n: _replace(
            _mha_layers(lay, n), 1, (*_mha_layers(lay, n)[1], _mha_layers(lay, n)[1][0])
        ),
        r"layer 1 must be a \(k, v\) pair",
    ),
    "layer-is-none": (
        lambda lay, n: _replace(_mha_layers(lay, n), 0, None),
        r"layer 0 must be a \(k, v\) pair",
    ),
    "v-head-dim-differs": (
        lambda lay, n: _replace(
            _mha_layers(lay, n),
            1,
            (_mha_layers(lay, n)[1][0], torch.zeros(n, 2, 4, dtype=lay.dtype)),
        ),
        r"layer 1 v has shape \[128, 2, 4\].*\[128, 2, 8\]",
    ),
    "k-heads-differ": (
        lambda lay, n: _replace(
            _mha_layers(lay, n),
            0,
            (torch.zeros(n, 3, 8, dtype=lay.dtype), _mha_layers(lay, n)[0][1]),
        ),
        r"layer 0 k has shape \[128, 3, 8\]",
    ),
    "k-v-token-counts-differ": (
        lambda lay, n: _replace(
            _mha_layers(lay, n),
            1,
            (_mha_layers(lay, n)[1][0], torch.zeros(*_kv_shape(n - 1), dtype=lay.dtype)),
        ),
        r"layer 1 v has shape \[127, 2, 8\]",
    ),
    "v-wrong-dtype": (
        lambda lay, n: _replace(
            _mha_layers(lay, n),
            0,
            (_mha_layers(lay, n)[0][0], _mha_layers(lay, n)[0][1].to(torch.bfloat16)),
        ),
        r"layer 0 v has dtype torch.bfloat16.*float16",
    ),
    "k-not-tensor": (
        lambda lay, n: _replace(_mha_layers(lay, n), 1, ([[0.0]] * n, _mha_layers(lay, n)[1][1])),
        r"layer 1 k must be a torch.Tensor",
    ),
    "layers-one-tensor": (
        lambda lay, n: torch.zeros(2, 2, *_kv_shape(n), dtype=lay.dtype),
        r"layers must be a sequence of 2",
    ),
    "rows-for-other-length": (
        lambda lay, n: _mha_layers(lay, n + BLOCK_TOKENS),
        r"layer 0 k has shape \[192, 2, 8\].*\[128, 2, 8\]",
    ),
    "meta-v": (
        lambda lay, n: _replace(
            _mha_layers(lay, n),
            1,
            (_mha_layers(lay, n)[1][0], torch.empty(*_kv_shape(n), dtype=lay.dtype, device="meta")),
        ),
        r"layer 1 v is on the meta device",
    ),
    "sparse-k": (
        lambda lay, n: _replace(
            _mha_layers(lay, n),
            0,
            (_mha_layers(lay, n)[0][0].to_sparse(), _mha_layers(lay, n)[0][1]),
        ),
        r"layer 0 k has layout torch.sparse_coo",
    ),
}


@pytest.mark.parametrize("case", sorted(MHA_BAD_LAYERS))
def test_mha_bad_layers_rejected(kv: TenantKV, mha: Namespace, case: str) -> None:
    make, match = MHA_BAD_LAYERS[case]
    tokens = random_tokens(128, seed=12)
    check_rejected_store(kv, mha, tokens, make(MHA_SMALL, 128), match, tokens)


def test_valid_mha_layers_as_lists_are_accepted(kv: TenantKV, mha: Namespace) -> None:
    """Control for the pair checks: a [k, v] list is a pair too, and round-trips."""
    tokens = random_tokens(64, seed=13)
    layers = random_layers(MHA_SMALL, 64, seed=13)
    as_lists = [list(layer) for layer in layers]
    assert mha.store(tokens, as_lists) == 64
    loaded = load_all(mha, tokens)
    for got, want in zip(loaded, layers, strict=True):
        assert isinstance(got, tuple) and isinstance(want, tuple)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- tokens -------------------------------------------------------------------------------------

_VALID = random_tokens(128, seed=21)

BAD_TOKENS: dict[str, tuple[Any, str]] = {
    "nested-list": ([_VALID[:64], _VALID[64:]], r"tokens must be a flat sequence"),
    "2d-tensor": (torch.tensor(_VALID).reshape(2, 64), r"tokens must be 1-D, got shape \[2, 64\]"),
    "2d-numpy": (np.asarray(_VALID).reshape(64, 2), r"tokens must be 1-D, got shape \[64, 2\]"),
    "0d-tensor": (torch.tensor(5), r"tokens must be 1-D"),
    "float-tensor": (torch.tensor(_VALID, dtype=torch.float32), r"tokens must be integers"),
    "float-numpy": (np.asarray(_VALID, dtype=np.float64), r"tokens must be integers"),
    "bool-tensor": (torch.ones(128, dtype=torch.bool), r"tokens must be integers"),
    "bool-numpy": (np.ones(128, dtype=np.bool_), r"tokens must be integers"),
    "float-list": ([float(t) for t in _VALID], r"integer ids"),
    "bool-list": ([True] * 128, r"integer ids"),
    "one-bool-in-list": ([*_VALID[:127], True], r"integer ids"),
    "negative-id": ([*_VALID[:100], -1, *_VALID[101:]], r"token ids must lie in \[0, 4294967295\]"),
    "negative-tensor": (torch.tensor([-5] * 128), r"token ids must lie in"),
    "id-2**32": ([2**32, *_VALID[1:]], r"token ids must lie in \[0, 4294967295\]"),
    "id-2**63": ([*_VALID[:127], 2**63], r"token ids must lie in"),
    "id-2**64": ([*_VALID[:127], 2**64], r"token ids must lie in"),
    "id-huge-negative": ([-(2**70), *_VALID[1:]], r"token ids must lie in"),
    "uint64-numpy": (np.full(128, 2**64 - 1, dtype=np.uint64), r"token ids must lie in"),
    "int64-tensor-2**32": (torch.full((128,), 2**32, dtype=torch.int64), r"token ids must lie in"),
    "string": ("hello world", r"tokens must be a list of ints.*got str"),
    "bytes": (b"\x00" * 128, r"tokens must be a list of ints.*got bytes"),
    "list-of-strings": (["a"] * 128, r"integer ids"),
    "string-numpy": (np.asarray(["a"] * 128), r"tokens must be integers"),
    "none": (None, r"tokens must be a list of ints.*got NoneType"),
    "dict": ({0: 1}, r"tokens must be a list of ints.*got dict"),
    "meta-tensor": (torch.empty(128, dtype=torch.int64, device="meta"), r"tokens is on the meta"),
    "sparse-tensor": (torch.tensor(_VALID).to_sparse(), r"tokens has layout torch.sparse_coo"),
    "nested-tensor": (
        torch.nested.nested_tensor(
            [torch.tensor(_VALID[:64]), torch.tensor(_VALID[64:])], layout=torch.jagged
        ),
        r"tokens is a nested tensor",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_TOKENS))
def test_bad_tokens_rejected_by_store(kv: TenantKV, mla: Namespace, case: str) -> None:
    bad, match = BAD_TOKENS[case]
    layers = random_layers(MLA_SMALL, 128, seed=3)
    check_rejected_store(kv, mla, bad, layers, match, _VALID)


@pytest.mark.parametrize("case", sorted(BAD_TOKENS))
def test_bad_tokens_rejected_by_lookup_and_load(kv: TenantKV, mla: Namespace, case: str) -> None:
    bad, match = BAD_TOKENS[case]
    mla.store(_VALID, random_layers(MLA_SMALL, 128, seed=3))
    before = snapshot(kv)
    with pytest.raises(tenantkv.InvalidRequestError, match=match):
        mla.lookup(bad)
    with pytest.raises(tenantkv.InvalidRequestError, match=match):
        mla.load(bad)
    assert snapshot(kv) == before
    # Positive control: the valid tokens hit and load.
    assert mla.lookup(_VALID) == 128
    assert len(load_all(mla, _VALID)) == MLA_SMALL.num_layers


def test_token_containers_agree(kv: TenantKV, mla: Namespace) -> None:
    """Control for the token checks: list, tensor and numpy forms of valid ids are accepted."""
    assert mla.store(np.asarray(_VALID, dtype=np.int64), random_layers(MLA_SMALL, 128)) == 128
    assert mla.lookup(torch.tensor(_VALID, dtype=torch.int32)) == 128
    assert mla.lookup(tuple(_VALID)) == 128
    assert mla.lookup([np.int64(t) for t in _VALID]) == 128
    top = [2**32 - 1] * 64  # the largest valid id
    assert mla.store(top, random_layers(MLA_SMALL, 64)) == 64
    assert mla.lookup(np.asarray(top, dtype=np.uint32)) == 64
    # Ids 0 and 1 (the values a boolean would take) are ids when they are ints.
    low = [0, 1] * 32
    assert mla.store(low, random_layers(MLA_SMALL, 64)) == 64
    assert mla.lookup(torch.tensor(low)) == 64
    assert mla.lookup([np.int32(t) for t in low]) == 64


# ---- tenants ------------------------------------------------------------------------------------


def test_namespace_of_unknown_tenant(kv: TenantKV) -> None:
    kv.create_tenant("known")
    before = snapshot(kv)
    with pytest.raises(tenantkv.TenantNotFoundError, match="'nobody'"):
        kv.namespace("nobody", model="m", layout=MLA_SMALL)
    assert snapshot(kv) == before
    with pytest.raises(tenantkv.TenantNotFoundError, match="'nobody'"):
        kv.get_tenant("nobody")
    # Positive control: a known tenant's namespace is created on first use.
    kv.namespace("known", model="m", layout=MLA_SMALL)
    assert snapshot(kv)[0]["namespaces"] == before[0]["namespaces"] + 1


def test_duplicate_tenant(kv: TenantKV) -> None:
    first = kv.create_tenant("acme")
    before = snapshot(kv)
    with pytest.raises(tenantkv.TenantExistsError, match="'acme'"):
        kv.create_tenant("acme")
    assert snapshot(kv) == before
    assert kv.list_tenants() == [first]
    # Names are case-sensitive, and a different name is a new tenant (positive control).
    kv.create_tenant("ACME")
    assert snapshot(kv)[0]["tenants"] == before[0]["tenants"] + 1


BAD_TENANT_NAMES: dict[str, Any] = {
    "empty": "",
    "too-long": "a" * 129,
    "space-inside": "acme corp",
    "leading-space": " acme",
    "trailing-space": "acme ",
    "leading-dot": ".acme",
    "leading-dash": "-acme",
    "leading-underscore": "_acme",
    "slash": "acme/evil",
    "dotdot": "..",
    "newline": "acme\n",
    "nul": "acme\x00",
    "non-ascii": "acmé",
    "none": None,
    "int": 7,
    "bytes": b"acme",
}


@pytest.mark.parametrize("case", sorted(BAD_TENANT_NAMES))
def test_invalid_tenant_names(kv: TenantKV, case: str) -> None:
    name = BAD_TENANT_NAMES[case]
    before = snapshot(kv)
    with pytest.raises(tenantkv.InvalidRequestError, match="tenant name") as caught:
        kv.create_tenant(name)
    assert isinstance(caught.value, ValueError)
    assert repr(name) in str(caught.value)
    with pytest.raises(tenantkv.InvalidRequestError, match="tenant name"):
        kv.namespace(name, model="m", layout=MLA_SMALL)
    assert snapshot(kv) == before
    assert kv.list_tenants() == []


@pytest.mark.parametrize("name", ["a", "a" * 128, "Acme.corp_1-x", "0tenant"])
def test_valid_tenant_names_accepted(kv: TenantKV, name: str) -> None:
    """Control for the name checks: edge-of-valid names create a tenant."""
    before = snapshot(kv)
    assert kv.create_tenant(name).name == name
    assert snapshot(kv)[0]["tenants"] == before[0]["tenants"] + 1
    assert kv.get_tenant(name).name == name


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": ""}, "model"),
        ({"model": "m" * 257}, "model"),
        ({"model": "m\n"}, "model"),
        ({"model": None}, "model"),
        ({"scope": ""}, "scope"),
        ({"scope": "s" * 257}, "scope"),
        ({"scope": 3}, "scope"),
        ({"revision": ""}, "revision"),
        ({"layout": "mla"}, "layout"),
        ({"layout": None}, "layout"),
    ],
)
def test_invalid_namespace_arguments(kv: TenantKV, kwargs: dict[str, Any], match: str) -> None:
    kv.create_tenant("acme")
    args: dict[str, Any] = {"model": "m", "layout": MLA_SMALL, **kwargs}
    before = snapshot(kv)
    with pytest.raises(tenantkv.InvalidRequestError, match=match):
        kv.namespace("acme", **args)
    assert snapshot(kv) == before
    kv.namespace("acme", model="m", layout=MLA_SMALL, scope="s" * 256)  # positive control
    assert snapshot(kv)[0]["namespaces"] == before[0]["namespaces"] + 1


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: KVLayout.mla(0, 32, 8, torch.bfloat16), "num_layers"),
        (lambda: KVLayout.mla(True, 32, 8, torch.bfloat16), "num_layers"),
        (lambda: KVLayout.mla(2, -1, 8, torch.bfloat16), "kv_lora_rank"),
        (lambda: KVLayout.mla(2, 32, cast(Any, 1.5), torch.bfloat16), "rope_dim"),
        (lambda: KVLayout.mha(2, 0, 8, torch.float16), "num_kv_heads"),
        (lambda: KVLayout.mha(2, 2, 0, torch.float16), "head_dim"),
        (lambda: KVLayout.mha(2, 2, 8, torch.int32), "dtype"),
        (lambda: KVLayout.mla(2, 32, 8, torch.float64), "dtype"),
    ],
)
def test_invalid_layouts(build: Callable[[], KVLayout], match: str) -> None:
    with pytest.raises(tenantkv.InvalidRequestError, match=match):
        build()


# ---- load ---------------------------------------------------------------------------------------


def check_rejected_load(
    kv: TenantKV, ns: Namespace, tokens: Any, error: type[Exception], match: str, **kw: Any
) -> None:
    before = snapshot(kv)
    with pytest.raises(error, match=match):
        ns.load(tokens, **kw)
    assert snapshot(kv) == before


def test_load_of_uncached_prefix(kv: TenantKV, mla: Namespace) -> None:
    cached = random_tokens(128, seed=31)
    mla.store(cached, random_layers(MLA_SMALL, 128))
    other = random_tokens(128, seed=32)
    check_rejected_load(kv, mla, other, tenantkv.CacheMissError, r"only 0 of 128 tokens")
    # The same tokens cached in another tenant's namespace are still a miss here.
    kv.create_tenant("other")
    theirs = kv.namespace("other", model="bad-input", layout=MLA_SMALL)
    check_rejected_load(kv, theirs, cached, tenantkv.CacheMissError, r"only 0 of 128 tokens")
    assert len(load_all(mla, cached)) == MLA_SMALL.num_layers  # positive control


# ---- load into out= buffers ---------------------------------------------------------------------

_FILL = -7.0  # what every out= buffer holds before a load; a rejected load leaves it so


def _out_mla(rows: int = 128) -> list[torch.Tensor]:
    return [torch.full((rows, 40), _FILL, dtype=MLA_SMALL.dtype) for _ in range(3)]


def _overlapping_views() -> list[torch.Tensor]:
    pool = torch.full((400, 40), _FILL, dtype=MLA_SMALL.dtype)
    return [pool[0:128], pool[200:328], pool[100:228]]  # the third overlaps the first two


def _overlapping_k_v() -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (128, MHA_SMALL.num_kv_heads, MHA_SMALL.head_dim)
    pool = torch.full((300, *shape[1:]), _FILL, dtype=MHA_SMALL.dtype)
    other = [torch.full(shape, _FILL, dtype=MHA_SMALL.dtype) for _ in range(2)]
    return [(pool[0:128], pool[64:192]), (other[0], other[1])]  # k and v of layer 0 overlap


BAD_OUT: dict[str, tuple[str, Callable[[], list[Any]], str]] = {
    "meta-buffer": (
        "mla",
        lambda: [*_out_mla()[:2], torch.empty(128, 40, dtype=MLA_SMALL.dtype, device="meta")],
        r"out\[2\] is on the meta device",
    ),
    "sparse-buffer": (
        "mla",
        lambda: [_out_mla()[0], _out_mla()[1].to_sparse(), _out_mla()[2]],
        r"out\[1\] has layout torch.sparse_coo",
    ),
    "nested-buffer": (
        "mla",
        lambda: [
            _out_mla()[0],
            torch.nested.nested_tensor(list(_out_mla()[1].split(64)), layout=torch.jagged),
            _out_mla()[2],
        ],
        r"out\[1\] is a nested tensor",
    ),
    "overlapping-views": ("mla", _overlapping_views, r"out\[2\] shares memory with out\[0\]"),
    "same-buffer-twice": (
        "mla",
        lambda: (lambda b: [b[0], b[1], b[0][10:]])(_out_mla(138)),
        r"out\[2\] shares memory with out\[0\]",
    ),
    "overlapping-k-v": ("mha", _overlapping_k_v, r"out\[0\] v shares memory with out\[0\] k"),
}


def _filled(out: list[Any]) -> bool:
    tensors = [t for entry in out for t in (entry if isinstance(entry, tuple) else (entry,))]
    return all(t.is_meta or t.is_sparse or t.is_nested or bool((t == _FILL).all()) for t in tensors)


@pytest.mark.parametrize("case", sorted(BAD_OUT))
def test_bad_out_buffers_rejected_before_anything_is_loaded(
    kv: TenantKV, mla: Namespace, mha: Namespace, case: str
) -> None:
    """Meta, sparse and overlapping out= buffers are an InvalidRequestError before any read:
    no buffer was written, the cache is unchanged; the same load into proper buffers works."""
    which, make, match = BAD_OUT[case]
    ns = mla if which == "mla" else mha
    tokens = random_tokens(128, seed=35)
    layers = random_layers(ns.layout, 128, seed=35)
    assert ns.store(tokens, layers) == 128
    out = make()
    check_rejected_load(kv, ns, tokens, tenantkv.InvalidRequestError, match, out=out)
    assert _filled(out), "a rejected load wrote into an out= buffer"
    # Positive control: disjoint views of one pool are fine, and receive the layers.
    if which == "mla":
        pool = torch.full((3 * 128, 40), _FILL, dtype=MLA_SMALL.dtype)
        good: list[Any] = [pool[i * 128 : (i + 1) * 128] for i in range(3)]
    else:
        shape = (128, MHA_SMALL.num_kv_heads, MHA_SMALL.head_dim)
        pool = torch.full((4 * 128, *shape[1:]), _FILL, dtype=MHA_SMALL.dtype)
        good = [
            (pool[2 * i * 128 : (2 * i + 1) * 128], pool[(2 * i + 1) * 128 : (2 * i + 2) * 128])
            for i in range(2)
        ]
    with ns.load(tokens, out=good) as stream:
        received = [layer for _index, layer in stream]
    for got, want in zip(received, layers, strict=True):
        if isinstance(want, tuple):
            assert isinstance(got, tuple)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        else:
            assert isinstance(got, torch.Tensor) and torch.equal(got, want)


def test_out_buffer_sharing_memory_with_the_tokens_is_rejected(
    kv: TenantKV, mla: Namespace
) -> None:
    tokens = random_tokens(128, seed=36)
    mla.store(tokens, random_layers(MLA_SMALL, 128, seed=36))
    out = _out_mla()
    out[1].zero_()
    aliased = out[1].view(torch.int32).flatten()[:128]  # token ids 0: a valid, uncached prefix
    mla.store(aliased.tolist(), random_layers(MLA_SMALL, 128, seed=37))
    check_rejected_load(
        kv,
        mla,
        aliased,
        tenantkv.InvalidRequestError,
        r"(tokens|out\[1\]) shares memory with (out\[1\]|tokens)",
        out=out,
    )
    # Positive control: the same tokens as a copy load into the same buffers.
    with mla.load(aliased.clone(), out=out) as stream:
        assert len([layer for _i, layer in stream]) == 3
    assert not _filled(out)


def test_load_of_partially_cached_prefix(kv: TenantKV, mla: Namespace) -> None:
    tokens = random_tokens(256, seed=33)
    mla.store(tokens[:128], random_layers(MLA_SMALL, 128))
    check_rejected_load(kv, mla, tokens, tenantkv.CacheMissError, r"only 128 of 256 tokens")
    check_rejected_load(kv, mla, tokens[:192], tenantkv.CacheMissError, r"only 128 of 192")
    # A diverging last block is a partial hit too.
    changed = [*tokens[:127], tokens[127] + 1]
    check_rejected_load(kv, mla, changed, tenantkv.CacheMissError, r"only 64 of 128")
    assert len(load_all(mla, tokens[:128])) == MLA_SMALL.num_layers  # positive control


@pytest.mark.parametrize("length", [0, 1, 63, 65, 100, 127, 129])
def test_load_of_partial_block_lengths(kv: TenantKV, mla: Namespace, length: int) -> None:
    tokens = random_tokens(192, seed=34)
    mla.store(tokens, random_layers(MLA_SMALL, 192))
    check_rejected_load(
        kv,
        mla,
        tokens[:length],
        tenantkv.InvalidRequestError,
        rf"whole number of 64-token blocks \(got {length} tokens\)",
    )
    assert len(load_all(mla, tokens[: (length // 64) * 64 or 64])) == MLA_SMALL.num_layers


@pytest.mark.parametrize("device", ["meta", "mps", "xla", "hpu", torch.device("meta")])
def test_load_to_unsupported_device(kv: TenantKV, mla: Namespace, device: Any) -> None:
    tokens = random_tokens(64, seed=35)
    mla.store(tokens, random_layers(MLA_SMALL, 64))
    check_rejected_load(
        kv, mla, tokens, tenantkv.InvalidRequestError, r"device .* is not supported", device=device
    )
    with mla.load(tokens, device="cpu") as stream:  # positive control
        assert stream.device == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_load_to_cuda_without_cuda(kv: TenantKV, mla: Namespace) -> None:
    tokens = random_tokens(64, seed=36)
    mla.store(tokens, random_layers(MLA_SMALL, 64))
    check_rejected_load(
        kv, mla, tokens, tenantkv.InvalidRequestError, r"cuda.* not available", device="cuda"
    )


@pytest.mark.parametrize("device", ["tpu", "gpu", "nonsense"])
def test_load_to_unknown_device_string(kv: TenantKV, mla: Namespace, device: str) -> None:
    tokens = random_tokens(64, seed=37)
    mla.store(tokens, random_layers(MLA_SMALL, 64))
    check_rejected_load(
        kv, mla, tokens, tenantkv.InvalidRequestError, rf"device.*{device}", device=device
    )


# ---- open ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("suite", ["bogus", "aes-128-gcm", "", 99, -1])
@pytest.mark.usefixtures("index")
def test_open_with_bad_suite(tmp_path: Path, suite: Any) -> None:
    with pytest.raises(tenantkv.InvalidRequestError, match=r"(?i)suite") as caught:
        tenantkv.open(tmp_path / "cache", suite=suite, durable=False)
    assert isinstance(caught.value, ValueError)
    # Positive control: the known suites open.
    for good in ("aes-256-gcm", "AES-256-OCB3"):
        with tenantkv.open(tmp_path / good, suite=good, durable=False) as kv:
            assert kv.info()["cipher_suite"] == good.upper().replace("-", "_")


def test_open_with_suite_none(tmp_path: Path) -> None:
    suite: Any = None
    with pytest.raises(tenantkv.InvalidRequestError, match="suite"):
        tenantkv.open(tmp_path / "cache", suite=suite, durable=False)


def test_open_with_bad_suite_creates_nothing(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    with pytest.raises(tenantkv.InvalidRequestError):
        tenantkv.open(root, suite="bogus", durable=False)
    assert not root.exists()


# ---- closed cache -------------------------------------------------------------------------------

CLOSED_CALLS: dict[str, Callable[[TenantKV], object]] = {
    "create_tenant": lambda kv: kv.create_tenant("late"),
    "get_tenant": lambda kv: kv.get_tenant("acme"),
    "list_tenants": lambda kv: kv.list_tenants(),
    "namespace": lambda kv: kv.namespace("acme", model="m", layout=MLA_SMALL),
    "info": lambda kv: kv.info(),
}


@pytest.mark.parametrize("call", sorted(CLOSED_CALLS))
def test_cache_use_after_close(cache_root: Path, call: str) -> None:
    kv = tenantkv.open(cache_root, durable=False)
    kv.create_tenant("acme")
    CLOSED_CALLS[call](kv)  # positive control: works while open
    tenants = [t.name for t in kv.list_tenants()]
    kv.close()
    kv.close()  # idempotent
    with pytest.raises(tenantkv.CacheClosedError, match="closed"):
        CLOSED_CALLS[call](kv)
    with tenantkv.open(cache_root, durable=False) as reopened:  # the failed call changed nothing
        assert [t.name for t in reopened.list_tenants()] == tenants


NAMESPACE_CALLS: dict[str, Callable[[Namespace, list[int]], object]] = {
    "lookup": lambda ns, tokens: ns.lookup(tokens),
    "store": lambda ns, tokens: ns.store(
        random_tokens(128, seed=41), random_layers(MLA_SMALL, 128)
    ),
    "load": lambda ns, tokens: ns.load(tokens),
}


@pytest.mark.parametrize("call", sorted(NAMESPACE_CALLS))
def test_namespace_use_after_close(cache_root: Path, call: str) -> None:
    kv = tenantkv.open(cache_root, durable=False)
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    tokens = random_tokens(128, seed=40)
    ns.store(tokens, random_layers(MLA_SMALL, 128))
    kv.close()
    with pytest.raises(tenantkv.CacheClosedError, match="closed"):
        NAMESPACE_CALLS[call](ns, tokens)
