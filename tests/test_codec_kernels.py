"""The codecs' fast decoders held to the decoders they replaced (tests/codec_reference.py).

Both paths a decode takes are checked: the one-pass C decoders (``tenantkv/_codec_kernels.c``,
CPU tensors) and the torch path (CUDA tensors, and installs without a C compiler; here forced by
hiding the C module). fp8 must give the reference's values bit for bit: both compute the float32
product of the e4m3 value and the scale and round it once to the output dtype. int4 from the
torch path must too (it runs the reference's own operations, only writing into the destination);
from the C path it may differ by one rounding: the C decoder computes a group's inverse rotation
exactly (an integer Walsh-Hadamard transform of the codes, times the group's scale and the
matrix's coefficient, rounded once to float32), where the reference's float32 matrix product
rounds every term and partial sum. The float32 values then differ by at most a few float32 ulps
of the group's largest term, which can move the output across one rounding boundary of its
dtype: one unit in its last place (2^-8 relative for bfloat16, 2^-11 for float16), or, where a
value is near zero after cancellation, a few float32 ulps of the group's scale."""

from __future__ import annotations

import array
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tenantkv.codecs as codecs_module
from tenantkv import KVLayout
from tests import codec_reference as reference
from tests.codec_cases import DTYPES, LAYOUTS, codec_path, coded  # noqa: F401 (a fixture)

TOLERANCE = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-20}


def _values(layout: KVLayout, blocks: int, tokens: int, seed: int) -> torch.Tensor:
    """Normal values with an outlier channel, a zero, and a run of tiny values (e4m3
    subnormal codes after scaling) in every block."""
    generator = torch.Generator().manual_seed(seed)
    width = layout.values_per_token
    values = torch.randn(blocks * tokens, width, generator=generator)
    values[:, 3] *= 60
    values[::tokens, 0] = 0.0
    values[1::tokens, : width // 2] *= 1e-4
    return values.to(layout.dtype)


def _assert_int4_close(layout: KVLayout, got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` within one rounding of ``want`` (the module docstring says why): one unit in the
    last place of the output dtype, plus float32 noise of the largest value's size."""
    x, y = got.float(), want.float()
    bound = y.abs() * TOLERANCE[layout.dtype] + y.abs().amax() * 2**-18
    assert bool(((x - y).abs() <= bound).all()), float(((x - y).abs() - bound).max())


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_decodes_bit_for_bit_as_before(path: str, kind: str, dtype: torch.dtype) -> None:
    layout = coded("fp8", kind, dtype)
    values = _values(layout, 3, 64, seed=1)
    codes = layout.coder.encode(layout, values, 64)
    got = layout.coder.decode(layout, codes, 64)
    want = reference.decode(layout, codes, 64)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int4_decodes_as_before(path: str, kind: str, dtype: torch.dtype) -> None:
    layout = coded("int4", kind, dtype)
    values = _values(layout, 3, 64, seed=2)
    codes = layout.coder.encode(layout, values, 64)
    got = layout.coder.decode(layout, codes, 64)
    want = reference.decode(layout, codes, 64)
    assert got.dtype == dtype and got.shape == want.shape
    if path == "torch":
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        _assert_int4_close(layout, got, want)
    for c in layout.components():  # the fp8 part of int4 (MLA k_rot) is bit for bit either way
        if c.positional:
            part = slice(c.start, c.start + c.width)
            assert torch.equal(
                got[:, part].contiguous().view(torch.uint8),
                want[:, part].contiguous().view(torch.uint8),
            )


@given(
    seed=st.integers(0, 2**31 - 1),
    magnitude=st.floats(1e-3, 1e2),  # times 60 and 5 sigma stays finite in float16
    dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(list(LAYOUTS)),
)
@settings(max_examples=30, deadline=None)
def test_c_decoders_agree_with_the_reference_on_random_blocks(
    seed: int, magnitude: float, dtype: torch.dtype, kind: str
) -> None:
    if codecs_module.kernels is None:
        pytest.skip("tenantkv was installed without a C compiler")
    for name in ("fp8", "int4"):
        layout = coded(name, kind, dtype)
        values = (_values(layout, 2, 16, seed).float() * magnitude).to(dtype)
        codes = layout.coder.encode(layout, values, 16)
        got, want = layout.coder.decode(layout, codes, 16), reference.decode(layout, codes, 16)
        if name == "fp8":
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        else:
            _assert_int4_close(layout, got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_e4m3_code_at_every_kind_of_scale(path: str, dtype: torch.dtype) -> None:
    """All 256 codes times scales that make the products float32
    subnormals, output subnormals, ordinary values and overflows of the output dtype."""
    layout = dataclasses.replace(LAYOUTS["mla-small"], dtype=dtype).with_codec("fp8")
    scales = [1.0, 1 / 448, 3.7e-5, 2.0**-130, 1e-8, 2.0**-20, 300.0, 1e35, 1e36]
    tokens = 4  # c_KV: 4 tokens of 32 values, so codes 0..127, then 128..255 in the next segment
    segment = layout.segment_bytes(tokens)
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = torch.zeros(len(scales) * 2, segment, dtype=torch.uint8)
    for s, scale in enumerate(scales):
        for half in range(2):
            row = codes[2 * s + half]
            offset = 0
            for c in layout.components():
                size = tokens * c.width
                picked = every[(torch.arange(size) + 128 * half + 17 * offset) % 256]
                row[offset : offset + size] = picked
                row[offset + size : offset + size + 4] = torch.tensor([scale]).view(torch.uint8)
                offset += size + 4
    got = layout.coder.decode(layout, codes, tokens)
    want = reference.decode(layout, codes, tokens)
    # The two NaN codes (S.1111.111, which no encoder writes) give a NaN; which NaN's bits is
    # not kept. Every other code gives the reference's bits.
    nan = want.isnan()
    assert int(nan.sum()) == 2 * len(scales) and bool(got[nan].isnan().all())
    assert torch.equal(got[~nan].view(torch.uint8), want[~nan].view(torch.uint8))


@pytest.mark.parametrize("name", ["fp8", "int4"])
@pytest.mark.parametrize("kind", ["mla", "mha-128"])
def test_decode_into_writes_the_destination_rows_and_nothing_else(
    path: str, name: str, kind: str
) -> None:
    """Paged rows (blocks out of order, gaps between them): each block's rows get what a
    fresh decode gives, every other row keeps its bytes. MHA decodes into (k, v) buffers."""
    layout = coded(name, kind, torch.bfloat16)
    values = _values(layout, 3, 64, seed=3)
    codes = layout.coder.encode(layout, values, 64)
    whole = layout.coder.decode(layout, codes, 64)
    starts = [320, 0, 128]
    components = layout.components()
    if layout.kind == "mla":
        dst = torch.full((448, layout.values_per_token), -7.0, dtype=layout.dtype)
        layout.coder.decode_into(layout, codes, 64, [(dst, c.start) for c in components], starts)
        placed = dst
    else:
        width = layout.num_kv_heads * layout.head_dim
        pair = [torch.full((448, width), -7.0, dtype=layout.dtype) for _ in range(2)]
        layout.coder.decode_into(layout, codes, 64, [(t, 0) for t in pair], starts)
        placed = torch.cat(pair, dim=1)
    filled = torch.zeros(448, dtype=torch.bool)
    for b, start in enumerate(starts):
        assert torch.equal(placed[start : start + 64], whole[64 * b : 64 * (b + 1)])
        filled[start : start + 64] = True
    assert bool((placed[~filled] == -7.0).all())


@pytest.mark.skipif(codecs_module.kernels is None, reason="built without a C compiler")
def test_the_c_decoders_refuse_offsets_past_their_buffers_and_write_nothing() -> None:
    kernels = codecs_module.kernels
    assert kernels is not None
    codes = bytearray(4 * 8 + 4)  # one segment: 4 tokens of 8 codes, then the scale
    codes[-4:] = bytes(memoryview(torch.tensor([1.0]).numpy()).cast("B"))
    dst = bytearray(b"\x11" * (4 * 8 * 2))
    rows = array.array("q", [0])
    kernels.fp8_scaled(codes, 0, 36, dst, 0, 16, rows, 4, 8, 0)  # fits: the control
    assert bytes(dst) == bytes(64)  # code 0 is +0.0
    dst[:] = b"\x11" * 64
    bad = [
        (codes, 0, 36, bytearray(63), 0, 16, rows, 4, 8, 0),  # destination one byte short
        (codes, 1, 36, dst, 0, 16, rows, 4, 8, 0),  # codes (and scale) past their end
        (codes, 0, 36, dst, 0, 16, array.array("q", [1]), 4, 8, 0),  # a row past the end
        (codes, 0, 36, dst, 0, 16, array.array("q", [-1]), 4, 8, 0),  # a negative row
        (codes, 0, 36, dst, 0, 8, rows, 4, 8, 0),  # rows wider than their stride
        (codes, 0, 36, dst, 0, 16, rows, 4, 8, 7),  # no such output kind
        (codes, -1, 36, dst, 0, 16, rows, 4, 8, 0),  # a negative offset
        # offsets whose products would overflow 64 bits if formed unchecked
        (codes, 0, 36, dst, 0, 16, array.array("q", [2**39]), 4, 8, 0),
        (codes, 0, 2**39, dst, 0, 16, array.array("q", [0, 4]), 4, 8, 0),
        (codes, 0, 36, dst, 0, 2**39, rows, 2**31, 8, 0),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            kernels.fp8_scaled(*args)
        assert bytes(dst) == b"\x11" * 64
    with pytest.raises(ValueError):  # a group that is not a power of two
        kernels.int4_hadamard(codes, 0, 36, dst, 0, 16, rows, 4, 8, 3, 0.5, 0)
    with pytest.raises(ValueError):  # codes and scales (4*4 + 4*2*2 bytes) past the end
        kernels.int4_hadamard(bytearray(31), 0, 32, dst, 0, 16, rows, 4, 8, 4, 0.5, 0)
    with pytest.raises(BufferError):  # a read-only destination
        kernels.fp8_scaled(codes, 0, 36, bytes(64), 0, 16, rows, 4, 8, 0)
    assert bytes(dst) == b"\x11" * 64


def test_an_int4_rotation_other_than_the_group_decodes_by_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The C decoder rotates each scale group on its own; a rotation block of another size
    (bench/codecs.py compares 1 and 512) must not reach it: such parts decode by the torch
    path, whose values the C decoder is never asked to match."""
    layout = coded("int4", "mla", torch.bfloat16)
    values = _values(layout, 2, 64, seed=4)
    for block in (1, 64):
        monkeypatch.setattr(codecs_module, "MAX_ROTATION", block)
        codes = layout.coder.encode(layout, values, 64)
        got = layout.coder.decode(layout, codes, 64)
        monkeypatch.setattr(codecs_module, "kernels", None)
        want = layout.coder.decode(layout, codes, 64)
        monkeypatch.undo()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        error = (got.float() - values.float()).norm() / values.float().norm()
        assert float(error) < 0.2  # still a working codec at that block
