"""Byte layout of one extent (what one store call writes), layer-major.

::

    offset                      size            content
    0                           32              header (below)
    32 + (l * B + b) * (S + 16) S + 16          sealed segment of block slot b, layer l

    header: b"TKVX" | u8 format version (1) | u8 cipher suite | u8 codec | u8 0
            | u32be B (blocks) | u32be L (layers) | u32be S (plaintext bytes per segment)
            | 12 zero bytes

All B segments of layer l are contiguous, so loading one layer of a prefix is one read per extent.
The codec byte names how segments are coded (``tenantkv.codecs``: 0 ``none``, 1 ``fp8``, 2
``int4``); extents written before codecs have 0 there and read as ``none``. The header is
cross-checked against the index and the namespace (a codec byte other than the namespace's is a
mismatch), and any mismatch (as any segment that fails to open) is treated as tampering. Its
codec byte is authenticated too: a coded extent's segments bind it in their associated data
(``tenantkv.crypto.SegmentContext.codec``), so a changed byte makes every segment fail to open.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..crypto import TAG_BYTES, CipherSuite

MAGIC = b"TKVX"
FORMAT_VERSION = 1
HEADER = struct.Struct(">4sBBBBIII12x")
HEADER_BYTES = HEADER.size


@dataclass(frozen=True, slots=True)
class ExtentGeometry:
    """Where each sealed segment of an extent lies."""

    num_blocks: int
    num_layers: int
    segment_bytes: int  # plaintext
    suite: CipherSuite
    codec: int = 0  # tenantkv.codecs ident; 0 is "none"

    @property
    def sealed_bytes(self) -> int:
        return self.segment_bytes + TAG_BYTES

    @property
    def layer_stride(self) -> int:
        """Bytes of one layer's segments, all blocks."""
        return self.num_blocks * self.sealed_bytes

    @property
    def total_bytes(self) -> int:
        return HEADER_BYTES + self.num_layers * self.layer_stride

    def offset(self, layer: int, slot: int) -> int:
        return HEADER_BYTES + layer * self.layer_stride + slot * self.sealed_bytes

    def header(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            self.suite,
            self.codec,
            0,
            self.num_blocks,
            self.num_layers,
            self.segment_bytes,
        )

    def matches_header(self, data: bytes) -> bool:
        return data == self.header()


def header_codec(data: bytes) -> int:
    """The codec byte of an extent header (not yet checked against anything)."""
    if len(data) < HEADER_BYTES:
        raise ValueError(f"an extent header is {HEADER_BYTES} bytes, got {len(data)}")
    return int(HEADER.unpack(data[:HEADER_BYTES])[3])
