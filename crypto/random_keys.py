"""Fresh random key material, from the operating system's CSPRNG."""

from __future__ import annotations

import secrets

from .segment import SALT_BYTES
from .suites import KEY_BYTES


def new_key() -> bytes:
    """A fresh 32-byte key (data keys, namespace hashing keys)."""
    return secrets.token_bytes(KEY_BYTES)


def new_salt() -> bytes:
    """A fresh extent salt."""
    return secrets.token_bytes(SALT_BYTES)
