"""Error types of the crypto layer.

Every failure to open sealed data (a segment, a wrapped key) raises :class:`SealOpenError`, whatever
the cause (wrong key, edited bytes, wrong associated data, bad length). Callers must not be able to
tell these causes apart, and must never act on partially opened data.
"""

from __future__ import annotations


class CryptoError(Exception):
    """Base class of every error raised by ``tenantkv.crypto``."""


class SealOpenError(CryptoError):
    """Sealed data failed to open: it was altered, moved, truncated, or sealed under another key."""


class MasterKeyError(CryptoError):
    """The master key could not be had: missing, unreadable, malformed, or a too-open key file."""
