"""The codecs' fast encoders held to the encoders they replaced (tests/codec_reference.py).

A store's bytes must not change with the encoder that wrote them: an extent written by the torch
path (CUDA tensors, installs without a C compiler, and every store before the C encoders) and one
written by the C encoders (``tenantkv/_codec_kernels.c``) must be the same bytes for the same
values, or a cache would hold two codings of one prefix. So every check here is equality of
bytes: on random and heavy-tailed blocks, zeros, values at e4m3's rounding boundaries, scales
that underflow, every bfloat16 and float16 bit pattern, and int4 rotations that overflow
float32 (which the C encoder hands back to the torch path)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tenantkv.codecs as codecs_module
from tenantkv import KVLayout
from tenantkv.errors import InvalidRequestError
from tests import codec_reference as reference
from tests.codec_cases import DTYPES, LAYOUTS, codec_path, coded  # noqa: F401 (a fixture)

needs_kernels = pytest.mark.skipif(
    codecs_module.kernels is None, reason="tenantkv was installed without a C compiler"
)


def _assert_same_bytes(layout: KVLayout, values: torch.Tensor, tokens: int) -> None:
    got = layout.coder.encode(layout, values, tokens)
    want = reference.encode(layout, values, tokens)
    assert got.dtype == torch.uint8 and got.shape == want.shape
    assert got.shape[1] == layout.segment_bytes(tokens)
    differ = (got != want).nonzero()
    assert differ.numel() == 0, f"{differ.shape[0]} bytes differ, first at {differ[0].tolist()}"


def _heavy_tailed(rows: int, width: int, seed: int, magnitude: float) -> torch.Tensor:
    """Normal values times a log-normal spread (a few values 100x their neighbours), two
    outlier channels, a zero row and a run of tiny values per 16 rows."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, width, generator=generator)
    values *= torch.exp(2 * torch.randn(rows, width, generator=generator))
    values[:, 1] *= 50
    values[:, width - 1] *= 30
    values[::16] = 0.0
    values[3::16, : width // 2] *= 1e-5
    return values * magnitude


@pytest.mark.parametrize("name", ["fp8", "int4"])
@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encoders_store_the_bytes_they_stored_before(
    path: str, name: str, kind: str, dtype: torch.dtype
) -> None:
    layout = coded(name, kind, dtype)
    values = _heavy_tailed(5 * 64, layout.values_per_token, seed=7, magnitude=0.3).to(dtype)
    _assert_same_bytes(layout, values, 64)


@given(
    seed=st.integers(0, 2**31 - 1),
    magnitude=st.sampled_from([1e-30, 1e-6, 1e-2, 1.0, 3.0, 100.0]),
    dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(list(LAYOUTS)),
    tokens=st.sampled_from([1, 2, 16, 64]),
)
@settings(max_examples=60, deadline=None)
def test_c_encoders_agree_with_the_reference_on_random_blocks(
    seed: int, magnitude: float, dtype: torch.dtype, kind: str, tokens: int
) -> None:
    if codecs_module.kernels is None:
        pytest.skip("tenantkv was installed without a C compiler")
    for name in ("fp8", "int4"):
        layout = coded(name, kind, dtype)
        values = _heavy_tailed(3 * tokens, layout.values_per_token, seed, magnitude)
        # float16 overflows past 65504: heavy tails at large magnitudes are clipped there
        values = values.clamp(-6e4, 6e4).to(dtype)
        _assert_same_bytes(layout, values, tokens)


def _sweep(patterns: torch.Tensor, dtype: torch.dtype, anchor: float, width: int) -> torch.Tensor:
    """Every finite value of ``patterns`` (bit patterns of ``dtype``) whose magnitude is at most
    ``anchor``, in rows of ``width`` with ``anchor`` first in each block of 64 rows (so every
    block's amax, and scale, is ``anchor``'s)."""
    values = patterns.view(dtype).float()
    values = values[values.isfinite() & (values.abs() <= anchor)]
    rows = -(-values.numel() // width)
    blocks = -(-rows // 64)
    out = torch.zeros(blocks * 64 * width)
    out[: values.numel()] = values
    out = out.view(blocks, 64 * width)
    out[:, 0] = anchor
    return out.view(blocks * 64, width).to(dtype)


#: Block amaxes (so scales) of the sweeps: 448 gives a scale of exactly 1 (values land on e4m3's
#: own rounding boundaries), the others scales that are not powers of two, large, small, and
#: subnormal in float32.
ANCHORS = [448.0, 1.0, 3.0, 7.0, 1e-3, 0.1, 6e4, 3e38, 1e-36, 2.0**-126, 1e-40]


@pytest.mark.parametrize("name", ["fp8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_16_bit_pattern_encodes_as_before(path: str, name: str, dtype: torch.dtype) -> None:
    """All 65,536 bit patterns of the 16-bit dtypes that are finite, under each anchor's
    scale, through both coders (fp8 for k_rot under either codec)."""
    layout = coded(name, "mla", dtype)
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    for anchor in ANCHORS:
        if dtype == torch.float16 and not 6e-8 < anchor <= 65504:
            continue  # not a float16 value
        values = _sweep(patterns, dtype, anchor, layout.values_per_token)
        _assert_same_bytes(layout, values, 64)


def test_e4m3_rounding_boundaries_encode_as_before(path: str) -> None:
    """float32 values at each midpoint between neighbouring e4m3 values, one float32 ulp either
    side, and past 448 (the clamp), at a scale of exactly 1 and at others."""
    layout = coded("fp8", "mla-small", torch.float32)
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = every.view(torch.float8_e4m3fn).float()
    grid = codes[codes.isfinite() & (codes >= 0)].sort().values
    mid = (grid[1:] + grid[:-1]) / 2
    near = torch.cat(
        (mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e9)), grid)
    )
    beyond = torch.tensor([448.0, 448.0001, 463.9, 464.0, 464.1, 479.9, 480.0, 500.0])
    near = torch.cat((near, -near))
    width = layout.values_per_token
    for scale in (1.0, 0.75, 3.1, 2.0**-10):
        anchored = torch.cat((torch.tensor([448.0]), near)) * scale
        rows = -(-anchored.numel() // width)
        values = torch.zeros(rows * width)
        values[: anchored.numel()] = anchored
        values = values.view(rows, width)
        padded = torch.zeros(-(-rows // 64) * 64, width)
        padded[:rows] = values
        _assert_same_bytes(layout, padded, 64)
    # values past 448 under a scale of 1 (the block's amax is one of them): the clamp
    for top in beyond:
        values = torch.zeros(64, width)
        values[0, :8] = beyond.clamp(max=float(top))
        values[1, :8] = -beyond.clamp(max=float(top))
        _assert_same_bytes(layout, values, 64)


def test_zeros_and_underflowing_scales_encode_as_before(path: str) -> None:
    """An all-zero block (scale 1) and float32 blocks whose amax is so small that amax / 448
    (and amax / 7) underflows to zero: torch's division then gives infinities and NaN codes,
    which the C encoders must reproduce too."""
    for name in ("fp8", "int4"):
        layout = coded(name, "mla", torch.float32)
        width = layout.values_per_token
        for fill in (0.0, -0.0, 1e-45, 3e-45, 1e-42, 1e-39):
            values = torch.full((128, width), fill)
            values[64:, ::3] = -fill
            values[70, 5] = 0.0
            _assert_same_bytes(layout, values, 64)


def test_an_int4_rotation_that_overflows_float32_encodes_by_the_torch_path(path: str) -> None:
    """Finite float32 values near float32's largest, whose Hadamard sums overflow to infinity:
    the C encoder leaves them to the torch path, whose bytes they keep."""
    layout = coded("int4", "mla", torch.float32)
    values = torch.full((64, layout.values_per_token), 3e38)
    values[:, 1::2] = 1.0
    values[5] = -1.0
    _assert_same_bytes(layout, values, 64)


@pytest.mark.parametrize("name", ["fp8", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_an_unchecked_encode_still_refuses_non_finite_values(
    path: str, name: str, bad: float
) -> None:
    """A store checks once (KVLayout.layer_rows) and tells the codec so; a direct encode, which
    no check preceded, still refuses a NaN or infinity with the store's error."""
    layout = coded(name, "mha-80", torch.bfloat16)
    values = torch.randn(128, layout.values_per_token).to(torch.bfloat16)
    values[100, 17] = bad
    with pytest.raises(InvalidRequestError, match="non-finite"):
        layout.coder.encode(layout, values, 64)


@needs_kernels
def test_the_c_encoders_refuse_bad_arguments_and_write_nothing() -> None:
    kernels = codecs_module.kernels
    assert kernels is not None
    values = bytearray(memoryview(torch.ones(4, 8).numpy()).cast("B"))  # 4 rows of 8 float32
    out = bytearray(b"\x11" * (4 * 8 + 4))
    kernels.fp8_encode(values, 2, 0, 32, 1, 4, 8, out, 0, 36)  # fits: the control
    scale = torch.tensor([1.0 / 448.0]).view(torch.uint8)
    assert out[-4:] == bytes(scale.tolist()) and out[:32] == bytes([0x7E]) * 32  # 1/scale: 448
    out[:] = b"\x11" * 36
    bad = [
        (values, 2, 0, 32, 1, 4, 8, bytearray(35), 0, 36),  # output one byte short
        (values, 2, 4, 32, 1, 4, 8, out, 0, 36),  # values past their end
        (values, 2, 0, 32, 2, 4, 8, out, 0, 36),  # a second segment of neither
        (values, 2, 0, 16, 1, 4, 8, out, 0, 36),  # rows wider than their stride
        (values, 2, 0, 32, 1, 4, 8, out, 0, 30),  # codes wider than the output stride
        (values, 5, 0, 32, 1, 4, 8, out, 0, 36),  # no such input kind
        (values, 2, -1, 32, 1, 4, 8, out, 0, 36),  # a negative offset
        (values, 2, 0, 32, 1, 0, 8, out, 0, 36),  # no tokens
        # counts whose products would overflow 64 bits if formed unchecked
        (values, 2, 0, 2**39, 2**30, 2**31, 8, out, 0, 36),
        (values, 2, 0, 32, 1, 4, 8, out, 2**39, 2**39),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            kernels.fp8_encode(*args)
        assert bytes(out) == b"\x11" * 36
    nan = bytearray(values)
    nan[20:24] = bytes(memoryview(torch.tensor([float("nan")]).numpy()).cast("B"))
    with pytest.raises(ValueError, match="not finite"):
        kernels.fp8_encode(nan, 2, 0, 32, 1, 4, 8, out, 0, 36)
    assert bytes(out) == b"\x11" * 36
    # int4: 4 tokens of 8 float32, groups of 4 -> 16 code bytes and 4*2 bfloat16 scales
    int4_out = bytearray(b"\x11" * 32)
    kernels.int4_encode(values, 1, 4, 8, 4, 0, int4_out, 0, 32)  # the control
    assert int4_out[:16] == bytes([0xFF]) * 16  # 1 / (1/7 in bfloat16) rounds to 7: code 15
    int4_out[:] = b"\x11" * 32
    for args in [
        (values, 1, 4, 8, 3, 0, int4_out, 0, 32),  # a group that is not a power of two
        (values, 1, 4, 8, 64, 0, int4_out, 0, 32),  # a group wider than 32
        (values, 2, 4, 8, 4, 0, int4_out, 0, 32),  # values past their end
        (values, 1, 4, 8, 4, 0, int4_out, 8, 32),  # codes past the end of the output
        (values, 1, 4, 8, 4, 4, int4_out, 0, 32),  # an offset into the values
        (nan, 1, 4, 8, 4, 0, int4_out, 0, 32),  # a value that is not finite
    ]:
        with pytest.raises(ValueError):
            kernels.int4_encode(*args)
        assert bytes(int4_out) == b"\x11" * 32
    with pytest.raises(BufferError):  # a read-only output
        kernels.fp8_encode(values, 2, 0, 32, 1, 4, 8, bytes(36), 0, 36)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_c_finite_scan_agrees_with_torch(dtype: torch.dtype) -> None:
    """The one non-finite check of a store (check_finite, by the C scan on the CPU): every
    16-bit pattern alone, and a NaN or infinity at any place of a long buffer (the scan goes in
    chunks), give torch's isfinite().all()."""
    kernels = codecs_module.kernels
    assert kernels is not None
    kind = codecs_module._KERNEL_KINDS[dtype]
    if dtype != torch.float32:
        patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
        got = [kernels.all_finite(codecs_module._bytes_of(p.reshape(1)), kind) for p in patterns]
        assert got == patterns.isfinite().tolist()
    else:
        edges = torch.tensor([3.4e38, -3.4e38, 1e-45, -0.0]).view(torch.int32)
        more = torch.tensor([0x7F800000, -8388608, 0x7FC00000, 0x7F800001], dtype=torch.int32)
        bits = torch.cat((edges, more))  # +inf, -inf, NaN, a signalling NaN
        got = [kernels.all_finite(codecs_module._bytes_of(b.reshape(1)), kind) for b in bits]
        assert got == bits.view(torch.float32).isfinite().tolist()
    values = torch.randn(10_000).to(dtype)
    assert kernels.all_finite(codecs_module._bytes_of(values), kind)
    for place in (0, 4095, 4096, 8191, 9_999):
        for bad in (float("nan"), float("inf"), float("-inf")):
            poisoned = values.clone()
            poisoned[place] = bad
            assert not kernels.all_finite(codecs_module._bytes_of(poisoned), kind)
    assert kernels.all_finite(b"", kind)
    with pytest.raises(ValueError):
        kernels.all_finite(b"\x00\x00\x00", kind if kind == 2 else 0)  # not whole values
    with pytest.raises(ValueError):
        kernels.all_finite(b"", 3)
