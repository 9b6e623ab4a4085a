"""Latent codecs: how a namespace's KV values become the bytes that are sealed, and back.

A namespace chooses one codec when it is made (``kv.namespace(..., codec=...)``); the codec is
part of its fingerprint and is recorded in every extent it writes. Every byte a codec does not
keep is a byte a disk hit need not read, decrypt or copy to the GPU.

* ``none`` (the default): the values' own bytes, byte for byte. Nothing here runs for it.
* ``fp8``: float8 e4m3 codes with one float32 scale per (block, layer, component) -- MLA's
  ``c_KV`` and ``k_rot`` scaled apart, MHA's K and V apart -- so one outlier channel only costs
  precision within its own block and component.
* ``int4``: each token's latent (MLA ``c_KV``) or head vector (MHA K, V) is rotated by an
  orthonormal Walsh-Hadamard transform in blocks of 32 channels, which spreads the few outlier
  channels that make plain low-bit codes fail over their block, then coded in 4 bits with one
  bfloat16 scale per block (group) of 32 rotated channels. MLA's ``k_rot`` (64 values of a
  576-value row, the part RoPE positions) stays in fp8 with a per-block scale: coding it in 4
  bits saves 32 B of 352 per token but triples its error (docs/perf.md, "Latent codecs").

Both lossy codecs are lossy: they are never byte-exact, and values that are not finite are
refused (e4m3 has no infinity; a NaN would poison a whole scale group).

Segment format (one (block, layer) segment of ``B`` tokens; the components in the layout
kind's order, each one after the other, all integers little-endian as torch stores them)::

    fp8 component of W values:   B*W bytes e4m3 codes (token-major) | 4 bytes float32 scale
    int4 component of W values:  B*W/2 bytes codes (two per byte, even channel in the low
                                 nibble, code = round(x/scale) + 8 in 1..15)
                                 | B*(W/G)*2 bytes bfloat16 scales (token-major, G = group size)

Encoding and decoding on a GPU are torch operations on the tensors' own device, so a GPU decodes
after the host-to-device copy and the link carries the codes. On the CPU a store encodes by the C
encoders of ``_codec_kernels.c`` where the install built them (each code written once, on one
thread, where the torch encoders made several float32 passes on torch's thread pool, which slowed
many times over when other work held the cores; docs/perf.md), which store exactly the torch
encoders' bytes (tests/test_codec_encoders.py); int4's rotation stays
torch's matrix product, whose rounding C does not reproduce. A store checks for non-finite
values once, in the layout's checks (``KVLayout.layer_rows``). A load decodes straight
into its destination rows (:meth:`Codec.decode_into`): on the CPU by the one-pass C decoders of
``_codec_kernels.c``, where the install built them, which write each value once (the torch path
took 5 to 10 times as long, docs/perf.md "Latent codecs"); fp8 gives the torch path's values bit
for bit, int4 within one rounding of the output dtype (tests/test_codec_kernels.py).
"""

from __future__ import annotations

import abc
import array
import functools
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .errors import InvalidRequestError


def _built_kernels() -> types.ModuleType | None:
    """The one-pass CPU decoders and encoders, where the install built them (setup.py: wherever
    a C compiler is at hand); None, and the torch path, elsewhere."""
    try:
        from . import _codec_kernels
    except ImportError:  # pragma: no cover - only an install without a C compiler
        return None
    return _codec_kernels


#: Swapped for None by the tests that hold the torch path to the same results.
kernels = _built_kernels()

#: The largest magnitude e4m3 (``float8_e4m3fn``) represents.
FP8_MAX = 448.0
#: The largest 4-bit code magnitude (codes are symmetric, -7..7, stored as 1..15).
INT4_MAX = 7.0
#: Channels per int4 scale (fewer when a vector's power-of-two factor is smaller).
INT4_GROUP = 32
#: The largest Walsh-Hadamard block a vector is rotated by: the int4 group. A rotation within
#: each scale group spreads an outlier channel over its own group only; one over the whole
#: latent (512) raised every group's scale, and its error on heavy-tailed latents (0.083 against
#: 0.052), and cost a 16 times larger matrix product (docs/perf.md, "Latent codecs").
MAX_ROTATION = 32


@dataclass(frozen=True, slots=True)
class Component:
    """One part of a token's row that a codec scales on its own (``c_kv``, ``k_rot``, ``k``,
    ``v``): values ``start .. start + width`` of the row, made of vectors of ``vector`` values
    (a head, or the whole latent) that an int4 rotation acts on."""

    name: str
    start: int
    width: int
    vector: int
    positional: bool  # carries RoPE positions (MLA k_rot); int4 keeps it at fp8


class CodedLayout(Protocol):
    """What a codec reads of a layout (``tenantkv.layout.KVLayout`` provides it)."""

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def values_per_token(self) -> int: ...
    def components(self) -> Sequence[Component]: ...


def _power_of_two_factor(n: int) -> int:
    return n & -n


# ---- component coders --------------------------------------------------------------------------


#: Where one component's decoded values go: a contiguous 2-D tensor ``[R, C]`` of the layout's
#: dtype (a load's destination rows, or one of an MHA ``out=`` pair's buffers as ``[R, H*D]``)
#: and the column its values start at. Segment ``j`` of a decode fills rows ``row_starts[j] ..
#: row_starts[j] + B`` of it.
Destination = tuple[torch.Tensor, int]

#: The C decoders' names for the dtypes they write.
_KERNEL_KINDS: dict[torch.dtype, int] = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _runs(row_starts: Sequence[int], block_tokens: int) -> list[tuple[int, int, int]]:
    """``(first segment, segment count, first row)`` of each run of segments whose destination
    rows follow one another, so the torch path copies a run at once."""
    runs: list[tuple[int, int, int]] = []
    for j, row in enumerate(row_starts):
        if runs and runs[-1][2] + runs[-1][1] * block_tokens == row:
            first, count, start = runs[-1]
            runs[-1] = (first, count + 1, start)
        else:
            runs.append((j, 1, row))
    return runs


def _uses_kernels(codes: torch.Tensor, destination: Destination) -> bool:
    """Whether the C decoders can take this decode: CPU tensors of a dtype they write."""
    dst = destination[0]
    return (
        kernels is not None
        and codes.device.type == "cpu"
        and dst.device.type == "cpu"
        and dst.dtype in _KERNEL_KINDS
    )


def _encodes_by_kernel(rows: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the C encoders can take this encode: CPU tensors of a dtype they read."""
    return (
        kernels is not None
        and rows.device.type == "cpu"
        and out.device.type == "cpu"
        and rows.dtype in _KERNEL_KINDS
    )


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory, as the C coders take it (writable: no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("the C coders take contiguous tensors")
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _kernel_buffers(
    codes: torch.Tensor, destination: Destination, row_starts: Sequence[int]
) -> tuple[memoryview, memoryview, int, int, array.array[int]]:
    """The codes', destination's and row starts' memory as the C decoders take it, with the
    destination's byte offset (its column) and row stride."""
    dst, column = destination
    if dst.dim() != 2 or not dst.is_contiguous():
        raise ValueError("a decode destination is a contiguous 2-D tensor")
    itemsize = dst.dtype.itemsize
    code_bytes = memoryview(codes.contiguous().numpy()).cast("B")  # type: ignore[arg-type]
    dst_bytes = memoryview(dst.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
    return (
        code_bytes,
        dst_bytes,
        column * itemsize,
        dst.shape[1] * itemsize,
        array.array("q", row_starts),
    )


class _Part(abc.ABC):
    """The coder of one component: ``[n, B, W]`` float32 values <-> ``[n, bytes]`` uint8."""

    def __init__(self, component: Component, block_tokens: int) -> None:
        self.component = component
        self.block_tokens = block_tokens

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of this component in one segment."""

    @abc.abstractmethod
    def encode(self, values: torch.Tensor) -> torch.Tensor: ...

    def encode_into(self, rows: torch.Tensor, out: torch.Tensor, offset: int) -> None:
        """Encode this component of ``rows`` (``[n * B, values_per_token]``, contiguous, of the
        layout's dtype) into bytes ``offset .. offset + nbytes`` of each row of ``out`` (``[n,
        segment_bytes]`` uint8). The C encoder where it applies: it writes each code once, where
        the torch path makes several float32 passes; the bytes are the same
        (tests/test_codec_encoders.py)."""
        c = self.component
        n = out.shape[0]
        if _encodes_by_kernel(rows, out) and self._encode_kernel(rows, out, offset):
            return
        blocks = rows.view(n, self.block_tokens, rows.shape[1])
        values = blocks[:, :, c.start : c.start + c.width].float()
        out[:, offset : offset + self.nbytes] = self.encode(values)

    @abc.abstractmethod
    def _encode_kernel(self, rows: torch.Tensor, out: torch.Tensor, offset: int) -> bool:
        """:meth:`encode_into` by the C encoder (CPU tensors only); False, having written
        nothing, where it leaves the values to the torch path."""

    @abc.abstractmethod
    def decode(self, codes: torch.Tensor) -> torch.Tensor: ...

    def decode_into(
        self,
        codes: torch.Tensor,
        offset: int,
        destination: Destination,
        row_starts: Sequence[int],
    ) -> None:
        """Decode this component of each segment of ``codes`` (``[n, segment_bytes]``; the
        component's bytes at ``offset``) straight into ``destination``. The C decoder where it
        applies, else :meth:`decode` and one copy per run of consecutive rows, which rounds the
        float32 values to the destination's dtype once (what CUDA tensors use)."""
        if self._kernel_fits() and _uses_kernels(codes, destination):
            self._decode_kernel(codes, offset, destination, row_starts)
            return
        values = self.decode(codes[:, offset : offset + self.nbytes])
        dst, column = destination
        width = self.component.width
        for first, count, start in _runs(row_starts, self.block_tokens):
            rows = count * self.block_tokens
            dst[start : start + rows, column : column + width].copy_(
                values[first : first + count].reshape(rows, width), non_blocking=True
            )

    def _kernel_fits(self) -> bool:
        """Whether the C decoder codes this part's format (the torch path codes any)."""
        return True

    @abc.abstractmethod
    def _decode_kernel(
        self,
        codes: torch.Tensor,
        offset: int,
        destination: Destination,
        row_starts: Sequence[int],
    ) -> None:
        """:meth:`decode_into` by the C decoder (CPU tensors only)."""


class _Fp8Part(_Part):
    """e4m3 codes, one float32 scale for the whole (block, layer, component)."""

    @property
    def nbytes(self) -> int:
        return self.block_tokens * self.component.width + 4

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        n = values.shape[0]
        amax = values.abs().amax(dim=(1, 2))
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        scaled = (values / scale[:, None, None]).clamp_(-FP8_MAX, FP8_MAX)
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, -1)
        return torch.cat((codes, scale.to(torch.float32).view(torch.uint8).view(n, 4)), dim=1)

    def _encode_kernel(self, rows: torch.Tensor, out: torch.Tensor, offset: int) -> bool:
        assert kernels is not None
        itemsize = rows.dtype.itemsize
        kernels.fp8_encode(
            _bytes_of(rows),
            _KERNEL_KINDS[rows.dtype],
            self.component.start * itemsize,
            rows.shape[1] * itemsize,
            out.shape[0],
            self.block_tokens,
            self.component.width,
            _bytes_of(out),
            offset,
            out.shape[1],
        )
        return True

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        n = codes.shape[0]
        size = self.block_tokens * self.component.width
        values = fp8_values(codes[:, :size])
        scale = codes[:, size : size + 4].contiguous().view(torch.float32)  # [n, 1]
        return values.mul_(scale).view(n, self.block_tokens, self.component.width)

    def _decode_kernel(
        self,
        codes: torch.Tensor,
        offset: int,
        destination: Destination,
        row_starts: Sequence[int],
    ) -> None:
        n = codes.shape[0]
        dtype = destination[0].dtype
        code_bytes, dst_bytes, dst_offset, stride, rows = _kernel_buffers(
            codes, destination, row_starts
        )
        assert kernels is not None
        kernels.fp8_scaled(
            code_bytes,
            offset,
            codes.shape[1] if n else 0,
            dst_bytes,
            dst_offset,
            stride,
            rows,
            self.block_tokens,
            self.component.width,
            _KERNEL_KINDS[dtype],
        )


def fp8_values(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (uint8, any shape) as float32 values, by a lookup in the 256 values e4m3 has:
    torch's own float8 conversion is a scalar loop on the CPU, and the lookup took 0.45 of its
    time on this project's 2-core machine (docs/perf.md, "Latent codecs"). Same values, bit for
    bit (``tests/test_codecs.py``)."""
    table = _fp8_table(codes.device)
    return table.index_select(0, codes.reshape(-1).to(torch.int32)).view(codes.shape)


@functools.lru_cache(maxsize=8)
def _fp8_table(device: torch.device) -> torch.Tensor:
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return every.view(torch.float8_e4m3fn).to(torch.float32).to(device)


@functools.lru_cache(maxsize=32)
def _hadamard(size: int, device: torch.device) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix of ``size`` (a power of two); symmetric, so it is
    its own inverse."""
    matrix = torch.ones((1, 1), dtype=torch.float32)
    while matrix.shape[0] < size:
        matrix = torch.cat(
            (torch.cat((matrix, matrix), dim=1), torch.cat((matrix, -matrix), dim=1)), dim=0
        )
    scaled: torch.Tensor = matrix / float(size) ** 0.5
    return scaled.to(device)


class _Int4Part(_Part):
    """A Walsh-Hadamard rotation of each vector, then 4-bit codes with a bfloat16 scale per
    group of channels."""

    def __init__(self, component: Component, block_tokens: int) -> None:
        super().__init__(component, block_tokens)
        factor = _power_of_two_factor(component.vector)
        self.rotation = min(factor, MAX_ROTATION)
        self.group = min(factor, INT4_GROUP)
        self.groups = component.width // self.group

    @property
    def nbytes(self) -> int:
        return self.block_tokens * (self.component.width // 2 + self.groups * 2)

    def _rotate(self, values: torch.Tensor) -> torch.Tensor:
        if self.rotation == 1:
            return values
        shape = values.shape
        matrix = _hadamard(self.rotation, values.device)
        return (values.reshape(-1, self.rotation) @ matrix).view(shape)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        n, tokens, width = values.shape
        grouped = self._rotate(values).view(n, tokens, self.groups, self.group)
        scale = (grouped.abs().amax(dim=3) / INT4_MAX).to(torch.bfloat16)
        wide = scale.to(torch.float32)
        safe = torch.where(wide > 0, wide, torch.ones_like(wide))
        codes = (grouped / safe[..., None]).round_().clamp_(-INT4_MAX, INT4_MAX).add_(8)
        codes = codes.to(torch.uint8).view(n, tokens, width)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return torch.cat((packed.reshape(n, -1), scale.view(torch.uint8).reshape(n, -1)), dim=1)

    def _encode_kernel(self, rows: torch.Tensor, out: torch.Tensor, offset: int) -> bool:
        # The rotation stays torch's float32 matrix product: its sums' rounding (the order and
        # fusing of the library's kernel) is not one C can reproduce bit for bit, and the stored
        # bytes must not change. The C encoder takes over from the rotated values: scales,
        # rounding and packing, which were six float32 passes.
        c = self.component
        n = out.shape[0]
        blocks = rows.view(n, self.block_tokens, rows.shape[1])
        rotated = self._rotate(blocks[:, :, c.start : c.start + c.width].float()).contiguous()
        assert kernels is not None
        try:
            kernels.int4_encode(
                _bytes_of(rotated),
                n,
                self.block_tokens,
                c.width,
                self.group,
                0,
                _bytes_of(out),
                offset,
                out.shape[1],
            )
        except ValueError:
            # A rotation of finite values that overflowed float32: the torch path's bytes.
            return False
        return True

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        n = codes.shape[0]
        tokens, width = self.block_tokens, self.component.width
        size = tokens * width // 2
        packed = codes[:, :size].reshape(n, tokens, width // 2)
        unpacked = torch.stack((packed & 0x0F, packed >> 4), dim=3).view(n, tokens, width)
        scales = codes[:, size : size + tokens * self.groups * 2].contiguous()
        scale = scales.view(torch.bfloat16).view(n, tokens, self.groups, 1).to(torch.float32)
        grouped = (unpacked.to(torch.float32) - 8).view(n, tokens, self.groups, self.group)
        return self._rotate((grouped * scale).view(n, tokens, width))

    def _kernel_fits(self) -> bool:
        # The C decoder rotates each scale group on its own: it needs the rotation block to be
        # the group, as MAX_ROTATION makes it (both the vector's power-of-two factor, at most
        # 32). Another block (bench/codecs.py compares some) decodes by the torch path.
        return self.rotation == self.group

    def _decode_kernel(
        self,
        codes: torch.Tensor,
        offset: int,
        destination: Destination,
        row_starts: Sequence[int],
    ) -> None:
        n = codes.shape[0]
        dtype = destination[0].dtype
        coefficient = float(_hadamard(self.rotation, torch.device("cpu"))[0, 0])
        code_bytes, dst_bytes, dst_offset, stride, rows = _kernel_buffers(
            codes, destination, row_starts
        )
        assert kernels is not None
        kernels.int4_hadamard(
            code_bytes,
            offset,
            codes.shape[1] if n else 0,
            dst_bytes,
            dst_offset,
            stride,
            rows,
            self.block_tokens,
            self.component.width,
            self.group,
            coefficient,
            _KERNEL_KINDS[dtype],
        )


# ---- codecs ------------------------------------------------------------------------------------


class Codec(abc.ABC):
    """How a namespace's values are stored. Registered by name (:func:`codec`)."""

    #: The name in ``kv.namespace(codec=)``, the fingerprint and the settings.
    name: str
    #: The byte that names the codec in an extent's header and its segments' associated data.
    ident: int
    #: Whether decoding gives back other values than were stored.
    lossy: bool

    def check(self, layout: CodedLayout) -> None:
        """InvalidRequestError when this codec cannot code ``layout``'s values (every layout
        can be stored as its own bytes)."""
        return None

    @abc.abstractmethod
    def segment_bytes(self, layout: CodedLayout, block_tokens: int) -> int:
        """Stored bytes of one (block, layer) segment."""

    @abc.abstractmethod
    def encode(
        self,
        layout: CodedLayout,
        values: torch.Tensor,
        block_tokens: int,
        *,
        checked: bool = False,
    ) -> torch.Tensor:
        """``[n * block_tokens, values_per_token]`` values of ``layout.dtype`` as ``[n,
        segment_bytes]`` uint8 (on the values' device). ``checked``: the caller has already
        refused non-finite values (a store's layout checks, ``KVLayout.layer_rows``), so a lossy
        codec does not scan them a second time (that scan was a quarter of a coded store)."""

    @abc.abstractmethod
    def decode(self, layout: CodedLayout, codes: torch.Tensor, block_tokens: int) -> torch.Tensor:
        """``[n, segment_bytes]`` uint8 as ``[n * block_tokens, values_per_token]`` values of
        ``layout.dtype`` (on the codes' device)."""

    def decode_into(
        self,
        layout: CodedLayout,
        codes: torch.Tensor,
        block_tokens: int,
        destinations: Sequence[Destination],
        row_starts: Sequence[int],
    ) -> None:
        """Decode ``[n, segment_bytes]`` codes straight into the caller's rows: component ``i``
        (``layout.components()`` order) of segment ``j`` into ``destinations[i]``, rows
        ``row_starts[j] ..`` (``n`` entries). A load writes each value once this way, where
        :meth:`decode` and a copy would write it twice. Here: :meth:`decode` and a copy."""
        values = self.decode(layout, codes, block_tokens)
        for c, (dst, column) in zip(layout.components(), destinations, strict=True):
            for first, count, start in _runs(row_starts, block_tokens):
                rows = count * block_tokens
                begin = first * block_tokens
                dst[start : start + rows, column : column + c.width].copy_(
                    values[begin : begin + rows, c.start : c.start + c.width], non_blocking=True
                )


class RawCodec(Codec):
    """The values' own bytes: byte-exact, and what every extent without a codec holds."""

    name = "none"
    ident = 0
    lossy = False

    def segment_bytes(self, layout: CodedLayout, block_tokens: int) -> int:
        return block_tokens * layout.values_per_token * layout.dtype.itemsize

    def encode(
        self,
        layout: CodedLayout,
        values: torch.Tensor,
        block_tokens: int,
        *,
        checked: bool = False,
    ) -> torch.Tensor:
        size = self.segment_bytes(layout, block_tokens)
        return values.contiguous().view(torch.uint8).view(-1, size)

    def decode(self, layout: CodedLayout, codes: torch.Tensor, block_tokens: int) -> torch.Tensor:
        return codes.contiguous().view(layout.dtype).view(-1, layout.values_per_token)


class _PartCodec(Codec):
    """A lossy codec made of one coder per component."""

    lossy = True

    @abc.abstractmethod
    def _part(self, component: Component, block_tokens: int) -> _Part: ...

    def check(self, layout: CodedLayout) -> None:
        if layout.dtype.itemsize == 1:
            raise InvalidRequestError(
                f"codec {self.name!r} codes 16- and 32-bit values; the layout's dtype "
                f"{layout.dtype} is already 8-bit (use codec 'none')"
            )

    def _parts(self, layout: CodedLayout, block_tokens: int) -> list[_Part]:
        return [self._part(c, block_tokens) for c in layout.components()]

    def segment_bytes(self, layout: CodedLayout, block_tokens: int) -> int:
        return sum(part.nbytes for part in self._parts(layout, block_tokens))

    def encode(
        self,
        layout: CodedLayout,
        values: torch.Tensor,
        block_tokens: int,
        *,
        checked: bool = False,
    ) -> torch.Tensor:
        if not checked:
            check_finite(self.name, values)
        rows = values.reshape(-1, layout.values_per_token).contiguous()
        if rows.shape[0] % block_tokens:
            raise ValueError("a codec encodes whole blocks")
        parts = self._parts(layout, block_tokens)
        out = torch.empty(
            (rows.shape[0] // block_tokens, sum(part.nbytes for part in parts)),
            dtype=torch.uint8,
            device=rows.device,
        )
        offset = 0
        for part in parts:
            part.encode_into(rows, out, offset)
            offset += part.nbytes
        return out

    def decode(self, layout: CodedLayout, codes: torch.Tensor, block_tokens: int) -> torch.Tensor:
        n = codes.shape[0]
        out = torch.empty(
            (n * block_tokens, layout.values_per_token), dtype=layout.dtype, device=codes.device
        )
        destinations = [(out, c.start) for c in layout.components()]
        self.decode_into(
            layout, codes, block_tokens, destinations, range(0, n * block_tokens, block_tokens)
        )
        return out

    def decode_into(
        self,
        layout: CodedLayout,
        codes: torch.Tensor,
        block_tokens: int,
        destinations: Sequence[Destination],
        row_starts: Sequence[int],
    ) -> None:
        parts = self._parts(layout, block_tokens)
        if len(destinations) != len(parts) or len(row_starts) != codes.shape[0]:
            raise ValueError("a decode needs a destination per component and a row per segment")
        offset = 0
        for part, destination in zip(parts, destinations, strict=True):
            part.decode_into(codes, offset, destination, row_starts)
            offset += part.nbytes


class Fp8Codec(_PartCodec):
    """e4m3 with a scale per (block, layer, component)."""

    name = "fp8"
    ident = 1

    def _part(self, component: Component, block_tokens: int) -> _Part:
        return _Fp8Part(component, block_tokens)


class Int4Codec(_PartCodec):
    """Hadamard-rotated 4-bit codes with a scale per group of channels; positional parts
    (MLA ``k_rot``) in fp8."""

    name = "int4"
    ident = 2

    def check(self, layout: CodedLayout) -> None:
        super().check(layout)
        for c in layout.components():
            if not c.positional and c.vector % 2:
                raise InvalidRequestError(
                    f"codec 'int4' packs two values a byte; {c.name} vectors have an odd "
                    f"length ({c.vector})"
                )

    def _part(self, component: Component, block_tokens: int) -> _Part:
        if component.positional:
            return _Fp8Part(component, block_tokens)
        return _Int4Part(component, block_tokens)


def check_finite(codec_name: str, values: torch.Tensor) -> None:
    """InvalidRequestError when ``values`` (bound for a lossy codec) hold a NaN or infinity. On
    the CPU by the C scan of the values' bits where it was built: torch's ``isfinite().all()``
    on an 8K-token DeepSeek-V3 bfloat16 layer took 6 ms, a third of a coded store."""
    if kernels is not None and values.device.type == "cpu" and values.dtype in _KERNEL_KINDS:
        finite = kernels.all_finite(_bytes_of(values.contiguous()), _KERNEL_KINDS[values.dtype])
    else:
        finite = bool(torch.isfinite(values).all())
    if not finite:
        raise InvalidRequestError(
            f"codec {codec_name!r} stores finite values only (e4m3 and 4-bit codes have no "
            "infinity or NaN); the layers hold a non-finite value"
        )


_CODECS: dict[str, Codec] = {c.name: c for c in (RawCodec(), Fp8Codec(), Int4Codec())}
_BY_IDENT: dict[int, Codec] = {c.ident: c for c in _CODECS.values()}
#: The codec names, default first.
CODEC_NAMES: tuple[str, ...] = tuple(_CODECS)


def codec(name: str) -> Codec:
    """The codec named ``name``; InvalidRequestError for a name that does not exist."""
    if not isinstance(name, str) or name not in _CODECS:
        raise InvalidRequestError(f"unknown codec {name!r}; use one of {', '.join(CODEC_NAMES)}")
    return _CODECS[name]


def codec_by_ident(ident: int) -> Codec | None:
    """The codec an extent header's byte names, or None for a byte no codec has."""
    return _BY_IDENT.get(ident)
