"""Types of the C accelerator tenantkv/_codec_kernels.c (see tenantkv.codecs)."""

from typing_extensions import Buffer

def fp8_scaled(
    codes: Buffer,
    codes_offset: int,
    codes_stride: int,
    dst: Buffer,
    dst_offset: int,
    dst_stride: int,
    row_starts: Buffer,
    tokens: int,
    width: int,
    kind: int,
    /,
) -> None: ...
def int4_hadamard(
    codes: Buffer,
    codes_offset: int,
    codes_stride: int,
    dst: Buffer,
    dst_offset: int,
    dst_stride: int,
    row_starts: Buffer,
    tokens: int,
    width: int,
    group: int,
    coefficient: float,
    kind: int,
    /,
) -> None: ...
