"""The lossy codecs' decoders as they were before the one-pass CPU decoders
(``tenantkv/_codec_kernels.c``) and the direct writes into the destination: a float32 table
lookup of the e4m3 codes times the scale, and the int4 unpacking, scaling and float32 Hadamard
matrix product, each component rounded once into a fresh tensor of the layout's dtype. And their
encoders as they were before the C encoders: float32 passes of torch operations and torch's own
float8 conversion, each component's bytes concatenated. Kept verbatim as the reference the fast
paths are held to (tests/test_codec_kernels.py, tests/test_codec_encoders.py): the stored bytes
must not change."""

from __future__ import annotations

import torch

from tenantkv.codecs import Component, _hadamard
from tenantkv.layout import KVLayout


def fp8_values(codes: torch.Tensor) -> torch.Tensor:
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    table = every.view(torch.float8_e4m3fn).to(torch.float32).to(codes.device)
    return table.index_select(0, codes.reshape(-1).to(torch.int32)).view(codes.shape)


def _fp8(component: Component, tokens: int, codes: torch.Tensor) -> torch.Tensor:
    n = codes.shape[0]
    size = tokens * component.width
    values = fp8_values(codes[:, :size])
    scale = codes[:, size : size + 4].contiguous().view(torch.float32)  # [n, 1]
    return values.mul_(scale).view(n, tokens, component.width)


def _int4(component: Component, tokens: int, codes: torch.Tensor) -> torch.Tensor:
    factor = component.vector & -component.vector
    rotation, group = min(factor, 32), min(factor, 32)
    groups = component.width // group
    n = codes.shape[0]
    width = component.width
    size = tokens * width // 2
    packed = codes[:, :size].reshape(n, tokens, width // 2)
    unpacked = torch.stack((packed & 0x0F, packed >> 4), dim=3).view(n, tokens, width)
    scales = codes[:, size : size + tokens * groups * 2].contiguous()
    scale = scales.view(torch.bfloat16).view(n, tokens, groups, 1).to(torch.float32)
    grouped = (unpacked.to(torch.float32) - 8).view(n, tokens, groups, group)
    values = (grouped * scale).view(n, tokens, width)
    matrix = _hadamard(rotation, values.device)
    return (values.reshape(-1, rotation) @ matrix).view(values.shape)


def part_bytes(codec: str, component: Component, tokens: int) -> int:
    """Bytes of one component in one segment (the format of tenantkv.codecs)."""
    if codec == "fp8" or component.positional:
        return tokens * component.width + 4
    group = min(component.vector & -component.vector, 32)
    return tokens * (component.width // 2 + component.width // group * 2)


def decode(layout: KVLayout, codes: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[n, segment_bytes]`` codes as ``[n * tokens, values_per_token]`` values."""
    n = codes.shape[0]
    out = torch.empty((n, tokens, layout.values_per_token), dtype=layout.dtype)
    offset = 0
    for c in layout.components():
        size = part_bytes(layout.codec, c, tokens)
        piece = codes[:, offset : offset + size]
        fp8 = layout.codec == "fp8" or c.positional
        values = _fp8(c, tokens, piece) if fp8 else _int4(c, tokens, piece)
        out[:, :, c.start : c.start + c.width] = values
        offset += size
    return out.view(n * tokens, layout.values_per_token)


def _encode_fp8(values: torch.Tensor) -> torch.Tensor:
    n = values.shape[0]
    amax = values.abs().amax(dim=(1, 2))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    scaled = (values / scale[:, None, None]).clamp_(-448.0, 448.0)
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, -1)
    return torch.cat((codes, scale.to(torch.float32).view(torch.uint8).view(n, 4)), dim=1)


def _encode_int4(component: Component, values: torch.Tensor) -> torch.Tensor:
    factor = component.vector & -component.vector
    rotation, group = min(factor, 32), min(factor, 32)
    groups = component.width // group
    n, tokens, width = values.shape
    matrix = _hadamard(rotation, values.device)
    rotated = (values.reshape(-1, rotation) @ matrix).view(values.shape)
    grouped = rotated.view(n, tokens, groups, group)
    scale = (grouped.abs().amax(dim=3) / 7.0).to(torch.bfloat16)
    wide = scale.to(torch.float32)
    safe = torch.where(wide > 0, wide, torch.ones_like(wide))
    codes = (grouped / safe[..., None]).round_().clamp_(-7.0, 7.0).add_(8)
    codes = codes.to(torch.uint8).view(n, tokens, width)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.cat((packed.reshape(n, -1), scale.view(torch.uint8).reshape(n, -1)), dim=1)


def encode(layout: KVLayout, values: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[n * tokens, values_per_token]`` values as ``[n, segment_bytes]`` codes."""
    blocks = values.reshape(-1, tokens, layout.values_per_token)
    pieces = []
    for c in layout.components():
        part = blocks[:, :, c.start : c.start + c.width].float()
        fp8 = layout.codec == "fp8" or c.positional
        pieces.append(_encode_fp8(part) if fp8 else _encode_int4(c, part))
    return torch.cat(pieces, dim=1)
