"""Latent codecs (tenantkv.codecs): error bounds of each codec, ``none`` byte-exact, every load
path (fresh, ``out=``, paged) giving exactly what the codec decodes, the codec in the extent's
header and the namespace's fingerprint, editing on coded namespaces, and the bad-input cases.
Every isolation check first shows the owner's hit (positive control)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tenantkv import InvalidRequestError, KVLayout, SegmentIntegrityError, TenantKV
from tenantkv.codecs import FP8_MAX, INT4_GROUP, codec
from tenantkv.crypto import CipherSuite, ExtentCipher, SealOpenError, SegmentContext
from tenantkv.datapath.extent_format import HEADER_BYTES, header_codec
from tenantkv.editing import EditScript, RopeSpec, edit_layers
from tenantkv.services.editing import edit_cached_prefix
from tests.helpers import load_all, random_layers, random_tokens

MLA = KVLayout.mla(num_layers=2, kv_lora_rank=32, rope_dim=8, dtype=torch.bfloat16)
MHA = KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
LOSSY = ("fp8", "int4")
EVENT = "segment_open_failed"


def rows_of(layout: KVLayout, layers: list[object], num_tokens: int) -> list[torch.Tensor]:
    return layout.validate_layers(layers, num_tokens)


def round_trip(layout: KVLayout, rows: torch.Tensor, block_tokens: int = 64) -> torch.Tensor:
    """What a store then a load of ``rows`` gives under ``layout``'s codec, as values."""
    full = rows.shape[0] // block_tokens * block_tokens
    coded = layout.encode_rows(rows[:full], block_tokens)
    if not layout.encoded:
        return coded.view(layout.dtype).view(full, -1)
    return layout.decode_rows(coded, block_tokens).view(layout.dtype).view(full, -1)


def as_rows(layout: KVLayout, layer: object) -> torch.Tensor:
    """A loaded layer as ``[T, values_per_token]`` values."""
    if isinstance(layer, torch.Tensor):
        return layer.reshape(layer.shape[0], -1)
    k, v = layer  # type: ignore[misc]
    return torch.stack((k, v), dim=1).reshape(k.shape[0], -1)


# ---- the codecs themselves -----------------------------------------------------------------------


finite_blocks = st.tuples(
    st.integers(1, 3),  # blocks
    st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    st.floats(1e-3, 1e2),  # magnitude (times 50 and 5 sigma stays finite in float16)
    st.integers(0, 2**31 - 1),  # seed
    st.booleans(),  # an outlier channel
)


def _values(layout: KVLayout, blocks: int, magnitude: float, seed: int, outlier: bool):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(blocks * 16, layout.values_per_token, generator=generator) * magnitude
    if outlier:
        values[:, 3] *= 50
    values[0, 0] = 0.0  # a zero is coded too
    return values.to(layout.dtype)


@pytest.mark.parametrize("kind", ["mla", "mha"])
@given(case=finite_blocks)
@settings(max_examples=40, deadline=None)
def test_none_is_byte_exact(kind: str, case: tuple) -> None:
    blocks, dtype, magnitude, seed, outlier = case
    base = MLA if kind == "mla" else MHA
    layout = dataclasses.replace(base, dtype=dtype)
    values = _values(layout, blocks, magnitude, seed, outlier)
    values[1, 1] = float("nan")  # none stores any bytes, NaN included
    rows = values.view(torch.uint8).view(values.shape[0], -1)
    got = codec("none").decode(layout, codec("none").encode(layout, values, 16), 16)
    assert torch.equal(got.view(torch.uint8).view(rows.shape), rows)
    assert layout.segment_bytes(16) == 16 * layout.token_bytes


@pytest.mark.parametrize("kind", ["mla", "mha"])
@given(case=finite_blocks)
@settings(max_examples=40, deadline=None)
def test_fp8_error_is_within_e4m3_rounding_of_the_blocks_scale(kind: str, case: tuple) -> None:
    blocks, dtype, magnitude, seed, outlier = case
    base = MLA if kind == "mla" else MHA
    layout = dataclasses.replace(base, dtype=dtype).with_codec("fp8")
    values = _values(layout, blocks, magnitude, seed, outlier)
    codes = layout.coder.encode(layout, values, 16)
    assert codes.shape == (blocks, layout.segment_bytes(16))
    got = layout.coder.decode(layout, codes, 16)
    assert got.dtype == dtype and got.shape == values.shape
    x, y = values.float(), got.float()
    for c in layout.components():
        part = x[:, c.start : c.start + c.width].reshape(blocks, -1)
        err = (y[:, c.start : c.start + c.width].reshape(blocks, -1) - part).abs()
        step = part.abs().amax(dim=1, keepdim=True) / FP8_MAX
        # e4m3: 3 mantissa bits (half a step = 1/16 relative), subnormal steps of 2^-9 of the
        # scale; then the caller's dtype rounds once more.
        bound = part.abs() * (1 / 16 + 1 / 64) + step * 2**-9 + 1e-30
        assert bool((err <= bound).all()), f"{c.name}: {float((err - bound).max())}"


@pytest.mark.parametrize("kind", ["mla", "mha"])
@given(case=finite_blocks)
@settings(max_examples=40, deadline=None)
def test_int4_error_is_within_half_a_code_step_of_each_group(kind: str, case: tuple) -> None:
    blocks, dtype, magnitude, seed, outlier = case
    base = MLA if kind == "mla" else MHA
    layout = dataclasses.replace(base, dtype=dtype).with_codec("int4")
    values = _values(layout, blocks, magnitude, seed, outlier)
    got = layout.coder.decode(layout, layout.coder.encode(layout, values, 16), 16)
    x, y = values.float(), got.float()
    for c in layout.components():
        part, back = x[:, c.start : c.start + c.width], y[:, c.start : c.start + c.width]
        if c.positional:  # MLA k_rot stays fp8
            assert bool(
                (
                    (back - part).abs()
                    <= part.abs() * (5 / 64) + 1e-30 + part.abs().amax() / FP8_MAX * 2**-9
                ).all()
            )
            continue
        # Rotated group g of G values has step s_g <= |y_g|_2 / 7 and error <= s_g / 2 (+1%
        # for the bfloat16 scale), so a vector's L2 error <= sqrt(G)/14 * 1.01 * its norm
        # (the rotation is orthonormal); plus the caller's dtype rounding.
        group = min(INT4_GROUP, c.vector & -c.vector)
        vectors = part.reshape(-1, c.vector)
        error = (back.reshape(-1, c.vector) - vectors).norm(dim=1)
        norm = vectors.norm(dim=1)
        assert bool((error <= norm * (group**0.5 / 14 * 1.01 + 2**-7) + 1e-30).all())


def test_int4_rotation_spreads_an_outlier_channel() -> None:
    """On heavy-tailed latents (a few channels 50x the rest) int4 with the rotation keeps the
    relative error near the Gaussian case; this is what the rotation is for."""
    layout = MLA.with_codec("int4")
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(256, layout.values_per_token, generator=generator)
    plain_error = _rel_error(layout, values.bfloat16())
    values[:, [1, 7, 20]] *= 50
    heavy_error = _rel_error(layout, values.bfloat16())
    assert plain_error < 0.12
    assert heavy_error < 0.12


def _rel_error(layout: KVLayout, values: torch.Tensor) -> float:
    got = layout.coder.decode(layout, layout.coder.encode(layout, values, 64), 64).float()
    rank = layout.kv_lora_rank
    ref = values.float()[:, :rank]
    return float((got[:, :rank] - ref).norm() / ref.norm())


def test_encoded_sizes_match_the_format() -> None:
    ds = KVLayout.mla(61, kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    assert ds.segment_bytes(64) == 64 * 1152
    # fp8: 576 codes a token, two float32 scales a block
    assert ds.with_codec("fp8").segment_bytes(64) == 64 * 576 + 2 * 4
    # int4: 256 B of c_KV codes and 16 bfloat16 group scales a token; k_rot fp8 + scale
    assert ds.with_codec("int4").segment_bytes(64) == 64 * (256 + 32) + 64 * 64 + 4


# ---- store and load ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [MLA, MHA], ids=["mla", "mha"])
@pytest.mark.parametrize("name", ["none", *LOSSY])
def test_load_fresh_out_and_paged_give_what_the_codec_decodes(
    kv: TenantKV, layout: KVLayout, name: str
) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=layout, codec=name)
    coded = layout.with_codec(name)
    assert ns.layout == coded
    tokens = random_tokens(200, seed=5)  # 3 full blocks and a partial one
    layers = random_layers(layout, 200, seed=5)
    assert ns.store(tokens, layers) == 192
    want = [round_trip(coded, rows) for rows in rows_of(layout, layers, 200)]

    fresh = load_all(ns, tokens[:192])
    for got, expected in zip(fresh, want, strict=True):
        assert torch.equal(as_rows(layout, got), expected)
        if name != "none":
            assert not torch.equal(
                expected, rows_of(layout, layers, 200)[0][:192].view(layout.dtype)
            )

    # out= buffers (contiguous) and paged rows (scattered blocks)
    for block_rows in (None, [128, 0, 256]):
        rows_needed = 192 if block_rows is None else 320
        out = [_buffer(layout, rows_needed) for _ in range(layout.num_layers)]
        with ns.load(tokens[:192], out=out, block_rows=block_rows) as stream:
            for index, _layer in stream:
                placed = as_rows(layout, out[index])
                starts = block_rows or [0, 64, 128]
                for b, start in enumerate(starts):
                    assert torch.equal(
                        placed[start : start + 64], want[index][64 * b : 64 * (b + 1)]
                    )


def _buffer(layout: KVLayout, rows: int) -> object:
    if layout.kind == "mla":
        return torch.zeros(rows, layout.values_per_token, dtype=layout.dtype)
    shape = (rows, layout.num_kv_heads, layout.head_dim)
    return torch.zeros(shape, dtype=layout.dtype), torch.zeros(shape, dtype=layout.dtype)


@pytest.mark.parametrize("name", LOSSY)
def test_stored_bytes_quota_and_metering_count_the_codes(
    kv: TenantKV, cache_root: Path, name: str
) -> None:
    kv.create_tenant("acme")
    layout = MLA
    plain = kv.namespace("acme", model="m", layout=layout)
    coded = kv.namespace("acme", model="m", layout=layout, codec=name)
    tokens = random_tokens(128, seed=2)
    layers = random_layers(layout, 128)
    assert plain.store(tokens, layers) == 128
    assert coded.store(tokens, layers) == 128
    files = sorted(
        (cache_root / "blocks" / "extents").glob("*/*.tkx"), key=lambda p: p.stat().st_size
    )
    assert len(files) == 2
    sealed = layout.num_layers * 2 * (layout.with_codec(name).segment_bytes(64) + 16)
    assert files[0].stat().st_size == HEADER_BYTES + sealed
    assert files[1].stat().st_size == HEADER_BYTES + layout.num_layers * 2 * (
        64 * layout.token_bytes + 16
    )
    assert header_codec(files[0].read_bytes()[:HEADER_BYTES]) == codec(name).ident
    assert header_codec(files[1].read_bytes()[:HEADER_BYTES]) == 0
    usage = kv.usage("acme")
    assert usage["stored_tokens"] == 256  # tokens metered as tokens, whatever the codec
    assert usage["stored_bytes"] == files[0].stat().st_size + files[1].stat().st_size


# ---- identity: fingerprint, header, associated data ----------------------------------------------


def test_a_namespace_of_another_codec_never_serves_these_blocks(kv: TenantKV) -> None:
    kv.create_tenant("acme")
    tokens = random_tokens(128, seed=9)
    layers = random_layers(MLA, 128)
    writer = kv.namespace("acme", model="m", layout=MLA, codec="fp8")
    assert writer.store(tokens, layers) == 128
    # Positive control: the same codec (a new handle, and a layout made with with_codec) hits.
    assert kv.namespace("acme", model="m", layout=MLA, codec="fp8").lookup(tokens) == 128
    assert kv.namespace("acme", model="m", layout=MLA.with_codec("fp8")).lookup(tokens) == 128
    for other in ("none", "int4"):
        assert kv.namespace("acme", model="m", layout=MLA, codec=other).lookup(tokens) == 0
    assert "codec" not in MLA.describe()  # fingerprints from before codecs are unchanged
    assert MLA.with_codec("int4").describe()["codec"] == "int4"


@pytest.mark.parametrize("forged", [0, 2])
def test_a_header_naming_another_codec_is_an_integrity_failure(
    kv: TenantKV, cache_root: Path, forged: int
) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA, codec="fp8")
    tokens = random_tokens(128, seed=4)
    ns.store(tokens, random_layers(MLA, 128))
    assert len(load_all(ns, tokens)) == MLA.num_layers  # positive control: it loads
    (extent,) = (cache_root / "blocks" / "extents").glob("*/*.tkx")
    data = bytearray(extent.read_bytes())
    assert data[6] == 1  # the codec byte
    data[6] = forged
    extent.write_bytes(bytes(data))
    assert ns.lookup(tokens) == 128
    with pytest.raises(SegmentIntegrityError), ns.load(tokens) as stream:
        for _ in stream:
            pass
    assert kv.security_events()[EVENT] == 1
    assert ns.lookup(tokens) == 0  # dropped


def test_segments_bind_their_codec_in_the_associated_data() -> None:
    key, salt, ids = bytes(32), bytes(16), bytes(16)
    suite = CipherSuite.AES_256_GCM
    sealer = ExtentCipher(key, salt, SegmentContext(ids, 1, ids, codec=1), suite)
    plain = memoryview(bytes(range(64)))
    sealed = bytearray(64 + 16)
    sealer.seal_into(0, 0, bytes(32), plain, memoryview(sealed))
    out = bytearray(64)
    ExtentCipher(key, salt, SegmentContext(ids, 1, ids, codec=1), suite).open_into(
        0, 0, bytes(32), memoryview(sealed), memoryview(out)
    )
    assert bytes(out) == bytes(plain)  # positive control
    for other in (0, 2):
        opener = ExtentCipher(key, salt, SegmentContext(ids, 1, ids, codec=other), suite)
        with pytest.raises(SealOpenError):
            opener.open_into(0, 0, bytes(32), memoryview(sealed), memoryview(out))


# ---- bad input ---------------------------------------------------------------------------------


def test_an_unknown_codec_is_an_invalid_request(kv: TenantKV) -> None:
    kv.create_tenant("acme")
    for bad in ("fp4", "FP8", "", 8):
        with pytest.raises(InvalidRequestError, match="unknown codec"):
            kv.namespace("acme", model="m", layout=MLA, codec=bad)  # type: ignore[arg-type]
    fp8_layout = KVLayout.mla(1, kv_lora_rank=8, rope_dim=4, dtype=torch.float8_e4m3fn)
    with pytest.raises(InvalidRequestError, match="already 8-bit"):
        kv.namespace("acme", model="m", layout=fp8_layout, codec="int4")
    odd = KVLayout.mha(1, num_kv_heads=1, head_dim=5, dtype=torch.float16)
    with pytest.raises(InvalidRequestError, match="odd"):
        kv.namespace("acme", model="m", layout=odd, codec="int4")


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused_under_a_lossy_codec(
    kv: TenantKV, name: str, bad: float
) -> None:
    kv.create_tenant("acme")
    tokens = random_tokens(64, seed=1)
    for layout in (MLA, MHA):
        ns = kv.namespace("acme", model="m", layout=layout, codec=name)
        layers = random_layers(layout, 64)
        poisoned = layers[1]
        (poisoned if isinstance(poisoned, torch.Tensor) else poisoned[1]).view(64, -1)[10, 3] = bad
        with pytest.raises(InvalidRequestError, match="non-finite"):
            ns.store(tokens, layers)
        assert ns.lookup(tokens) == 0  # nothing stored
        # positive control: finite values store
        assert ns.store(tokens, random_layers(layout, 64)) == 64


# ---- editing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [MLA, MHA], ids=["mla", "mha"])
@pytest.mark.parametrize("name", LOSSY)
def test_editing_a_coded_prefix_decodes_repositions_and_re_encodes(
    kv: TenantKV, layout: KVLayout, name: str
) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=layout, codec=name)
    tokens = random_tokens(256, seed=17)
    script = EditScript.dropping([(70, 100), (150, 170)])
    dims = layout.rope_dim if layout.kind == "mla" else layout.head_dim
    rope = RopeSpec.standard(10000.0, dims, "interleaved" if layout.kind == "mla" else "half")
    assert ns.store(tokens, random_layers(layout, 256, seed=3)) == 256
    parent = load_all(ns, tokens)
    result = edit_cached_prefix(ns, tokens, script, rope)
    assert result.stored_tokens == 128
    edited_tokens = result.tokens.tolist()[:192]
    assert ns.lookup(edited_tokens, origin=result.origin) == 192
    # The edit of what the parent decodes to, then coded again.
    expected = edit_layers(ns.layout, parent, 256, script, rope)
    with ns.load(edited_tokens, origin=result.origin) as stream:
        got = [layer for _, layer in stream]
    bound = 0.05 if name == "fp8" else 0.2
    for g, e in zip(got, expected, strict=True):
        want = as_rows(layout, e)[:192].float()
        error = float((as_rows(layout, g).float() - want).norm() / want.norm())
        assert error < bound
    # Not vacuous: the keys of tokens 100.. moved 30 positions, so they differ from the
    # parent's where they are now (only the position-carrying part: k_rot, or K).
    cols = slice(layout.kv_lora_rank, None) if layout.kind == "mla" else slice(0, 32)
    moved = as_rows(layout, parent[0])[100:192, cols].float()
    now = as_rows(layout, got[0])[70:162, cols].float()
    assert float((now - moved).norm() / moved.norm()) > 2 * bound


@pytest.mark.parametrize("name", LOSSY)
def test_re_sealing_under_a_new_key_keeps_the_codec(kv: TenantKV, name: str) -> None:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MHA, codec=name)
    tokens = random_tokens(128, seed=8)
    ns.store(tokens, random_layers(MHA, 128, seed=8))
    before = [as_rows(MHA, layer) for layer in load_all(ns, tokens)]
    kv.rotate_keys("acme")
    outcome = kv.retire_keys("acme")
    assert outcome["resealed"] == 1  # not vacuous: the extent was opened and sealed anew
    assert kv.security_events().get(EVENT, 0) == 0
    assert ns.lookup(tokens) == 128
    after = [as_rows(MHA, layer) for layer in load_all(ns, tokens)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_fp8_lookup_gives_torchs_own_e4m3_values() -> None:
    from tenantkv.codecs import fp8_values

    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    want = every.view(torch.float8_e4m3fn).to(torch.float32)
    got = fp8_values(every)
    finite = torch.isfinite(want)
    assert got.shape == (16, 16) and bool(finite.sum() == 254)  # 0x7F, 0xFF are NaN
    assert torch.equal(got[finite], want[finite]) and bool(got[~finite].isnan().all())
