"""Sealing of KV segments: one (block, layer) slice of a prefix, sealed on its own.

Keys and nonces
---------------
Each extent (one store call's blocks) gets a 16-byte random salt; the segments of that extent are
sealed under a subkey ``HKDF-SHA256(data_key, salt, info)`` and the nonce of a segment is its
position in the extent::

    subkey = HKDF-SHA256(ikm=data_key, salt=extent_salt, info=b"tenantkv/segment/v1" || suite, L=32)
    nonce  = u32be(layer) || u64be(slot)        # slot = block index inside the extent

An extent is written once and never rewritten, so under one subkey every nonce is used exactly
once. Subkeys of different extents differ unless two 128-bit random salts collide (for 2**48
extents under one data key the chance is below 2**-32), which keeps us clear of the 2**32
random-nonce bound of NIST SP 800-38D without counters or coordination between writers.

Associated data (binds a segment to where it belongs; all integers big-endian)::

    offset  size  field
    0       8     b"TKVSEG\\x00\\x01"  (magic and format version 1)
    8       1     cipher suite
    9       16    tenant id
    25      4     data key version
    29      16    namespace id
    45      32    block key (keyed prefix hash of the block)
    77      4     layer index
    81      4     plaintext length in bytes

A segment whose values are coded (``SegmentContext.codec`` not 0: a lossy latent codec of
tenantkv) has format version 2: magic ``b"TKVSEG\x00\x02"``, and one byte, the codec, at offset
45 after the namespace id (the block key, layer and length follow at 46, 78, 82). Segments of
codec 0 keep version 1 byte for byte, so extents sealed before codecs still open.

Sealed segment on disk: ``ciphertext (len = plaintext length) || tag (16 bytes)``. Moving a
segment to another tenant, namespace, block, layer or extent, or changing a single bit, makes it
fail to open with :class:`SealOpenError`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import SealOpenError
from .suites import KEY_BYTES, TAG_BYTES, CipherSuite

SEGMENT_FORMAT_VERSION = 1
SALT_BYTES = 16
ID_BYTES = 16
BLOCK_KEY_BYTES = 32
_AAD_MAGIC = b"TKVSEG\x00" + bytes([SEGMENT_FORMAT_VERSION])
_AAD_MAGIC_CODED = b"TKVSEG\x00\x02"
_AAD_HEAD = struct.Struct(">8sB16sI16s")
_AAD_TAIL = struct.Struct(">II")
_NONCE = struct.Struct(">IQ")
_SUBKEY_INFO = b"tenantkv/segment/v1"


@dataclass(frozen=True, slots=True)
class SegmentContext:
    """What a sealed segment is bound to, apart from its block key, layer and length."""

    tenant_id: bytes
    key_version: int
    namespace_id: bytes
    #: How the segments' values are coded (0: their own bytes). Bound into the associated data
    #: when not 0, so an extent's header cannot name another codec than its segments hold.
    codec: int = 0

    def __post_init__(self) -> None:
        if len(self.tenant_id) != ID_BYTES or len(self.namespace_id) != ID_BYTES:
            raise ValueError(f"tenant and namespace ids must be {ID_BYTES} bytes")
        if not 0 <= self.codec < 256:
            raise ValueError(f"codec {self.codec} is out of range")
        if not 0 <= self.key_version < 2**32:
            raise ValueError(f"key version {self.key_version} is out of range")


class ExtentCipher:
    """Seals and opens the segments of one extent.

    Thread-safe: the AEAD objects of ``cryptography`` hold no per-call state, so reader threads
    share one instance.
    """

    __slots__ = ("_aad_head", "_aead", "suite")

    def __init__(
        self, data_key: bytes, salt: bytes, context: SegmentContext, suite: CipherSuite
    ) -> None:
        if len(data_key) != KEY_BYTES:
            raise ValueError(f"a data key must be {KEY_BYTES} bytes")
        if len(salt) != SALT_BYTES:
            raise ValueError(f"an extent salt must be {SALT_BYTES} bytes")
        subkey = HKDF(
            algorithm=hashes.SHA256(),
            length=KEY_BYTES,
            salt=salt,
            info=_SUBKEY_INFO + bytes([suite]),
        ).derive(data_key)
        self.suite = suite
        self._aead = suite.new_aead(subkey)
        magic = _AAD_MAGIC_CODED if context.codec else _AAD_MAGIC
        self._aad_head = _AAD_HEAD.pack(
            magic, suite, context.tenant_id, context.key_version, context.namespace_id
        ) + (bytes([context.codec]) if context.codec else b"")

    def associated_data(self, block_key: bytes, layer: int, length: int) -> bytes:
        """The associated data of one segment (see the module docstring for the layout)."""
        if len(block_key) != BLOCK_KEY_BYTES:
            raise ValueError(f"a block key must be {BLOCK_KEY_BYTES} bytes")
        if not 0 <= layer < 2**32 or not 0 <= length < 2**32:
            raise ValueError(f"layer {layer} or length {length} is out of range")
        return self._aad_head + block_key + _AAD_TAIL.pack(layer, length)

    @staticmethod
    def nonce(layer: int, slot: int) -> bytes:
        """The nonce of segment (layer, slot): unique within an extent."""
        if not 0 <= layer < 2**32 or not 0 <= slot < 2**64:
            raise ValueError(f"layer {layer} or slot {slot} is out of range")
        return _NONCE.pack(layer, slot)

    def seal_into(
        self, slot: int, layer: int, block_key: bytes, plaintext: memoryview, out: memoryview
    ) -> None:
        """Seal ``plaintext`` into ``out``, which holds exactly ``len(plaintext) + 16`` bytes."""
        length = len(plaintext)
        if len(out) != length + TAG_BYTES:
            raise ValueError(f"output must hold {length + TAG_BYTES} bytes, has {len(out)}")
        aad = self.associated_data(block_key, layer, length)
        self._aead.encrypt_into(self.nonce(layer, slot), plaintext, aad, out)

    def seal_many_into(
        self,
        first_slot: int,
        layer: int,
        block_keys: Sequence[bytes],
        plaintexts: Sequence[memoryview],
        out: memoryview,
    ) -> None:
        """Seal consecutive segments ``first_slot ..`` of one layer (``plaintexts``, all the
        same length) into ``out``, packed back to back (``len(plaintexts) * (length + 16)``
        bytes).

        Equivalent to :meth:`seal_into` per segment, with the per-segment work cut to the AEAD
        call (stores seal thousands of segments per prefix). The AEAD call releases the GIL, so
        threads sealing different parts of an extent run in parallel.
        """
        count = len(plaintexts)
        if not count:
            return
        length = len(plaintexts[0])
        stride = length + TAG_BYTES
        if len(block_keys) != count or len(out) != count * stride:
            raise ValueError(f"output must hold {count * stride} bytes, has {len(out)}")
        if any(len(plaintext) != length for plaintext in plaintexts):
            raise ValueError("plaintext segments differ in length")
        if any(len(key) != BLOCK_KEY_BYTES for key in block_keys):
            raise ValueError(f"a block key must be {BLOCK_KEY_BYTES} bytes")
        self.nonce(layer, first_slot)  # range checks of the first and the last slot
        self.nonce(layer, first_slot + count - 1)
        if not 0 <= length < 2**32:
            raise ValueError(f"length {length} is out of range")
        head = self._aad_head
        tail = _AAD_TAIL.pack(layer, length)
        encrypt_into = self._aead.encrypt_into
        pack_nonce = _NONCE.pack
        for j, plaintext in enumerate(plaintexts):
            encrypt_into(
                pack_nonce(layer, first_slot + j),
                plaintext,
                head + block_keys[j] + tail,
                out[j * stride : (j + 1) * stride],
            )

    def open_many_into(
        self,
        first_slot: int,
        layer: int,
        block_keys: Sequence[bytes],
        sealed: memoryview,
        outs: Sequence[memoryview],
    ) -> None:
        """Open consecutive segments ``first_slot ..`` of one layer, packed back to back in
        ``sealed``, into ``outs`` (one view per segment, all the same length).

        Equivalent to :meth:`open_into` per segment, with the per-segment work cut to the
        AEAD call: loads open thousands of segments per prefix.
        """
        if not outs:
            return
        length = len(outs[0])
        stride = length + TAG_BYTES
        count = len(outs)
        if len(block_keys) != count or len(sealed) != count * stride:
            raise SealOpenError("sealed segments have the wrong length")
        if any(len(out) != length for out in outs):
            raise SealOpenError("output views differ in length")
        try:
            tail = _AAD_TAIL.pack(layer, length)
            self.nonce(layer, first_slot + count - 1)  # range check of the last (largest) slot
            self.nonce(layer, first_slot)
        except (ValueError, struct.error):
            raise SealOpenError("segment position is out of range") from None
        head = self._aad_head
        decrypt_into = self._aead.decrypt_into
        pack_nonce = _NONCE.pack
        try:
            for j, out in enumerate(outs):
                key = block_keys[j]
                if len(key) != BLOCK_KEY_BYTES:
                    raise SealOpenError("a block key has the wrong length")
                decrypt_into(
                    pack_nonce(layer, first_slot + j),
                    sealed[j * stride : (j + 1) * stride],
                    head + key + tail,
                    out,
                )
        except InvalidTag:
            raise SealOpenError("segment failed to open") from None

    def open_into(
        self, slot: int, layer: int, block_key: bytes, sealed: memoryview, out: memoryview
    ) -> None:
        """Open ``sealed`` into ``out`` (``len(sealed) - 16`` bytes) or raise SealOpenError.

        On failure the contents of ``out`` are unspecified; callers discard the whole buffer.
        """
        length = len(sealed) - TAG_BYTES
        if length < 0 or len(out) != length:
            raise SealOpenError("sealed segment has the wrong length")
        try:
            aad = self.associated_data(block_key, layer, length)
            nonce = self.nonce(layer, slot)
        except ValueError:
            raise SealOpenError("segment position is out of range") from None
        try:
            self._aead.decrypt_into(nonce, sealed, aad, out)
        except InvalidTag:
            raise SealOpenError("segment failed to open") from None
