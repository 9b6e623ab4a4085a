"""The lossy codecs' decoders as they were before the one-pass CPU decoders
(``tenantkv/_codec_kernels.c``) and the direct writes into the destination: a float32 table
lookup of the e4m3 codes times the scale, and the int4 unpacking, scaling and float32 Hadamard
matrix product, each component rounded once into a fresh tensor of the layout's dtype. Kept
verbatim as the reference the fast paths are held to (tests/test_codec_kernels.py)."""

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
