"""Keys and sealing for tenantkv: master key providers, key wrapping, segment AEAD."""

from .errors import CryptoError, MasterKeyError, SealOpenError
from .master_key import (
    MASTER_KEY_ENV,
    EnvKeyProvider,
    KeyEncryptionKey,
    KeyFileProvider,
    KeyWrapper,
    MasterKeyProvider,
    default_master_key_provider,
)
from .random_keys import new_key, new_salt
from .segment import (
    BLOCK_KEY_BYTES,
    ID_BYTES,
    SALT_BYTES,
    SEGMENT_FORMAT_VERSION,
    ExtentCipher,
    SegmentContext,
)
from .suites import DEFAULT_SUITE, KEY_BYTES, TAG_BYTES, CipherSuite

__all__ = [
    "BLOCK_KEY_BYTES",
    "DEFAULT_SUITE",
    "ID_BYTES",
    "KEY_BYTES",
    "MASTER_KEY_ENV",
    "SALT_BYTES",
    "SEGMENT_FORMAT_VERSION",
    "TAG_BYTES",
    "CipherSuite",
    "CryptoError",
    "EnvKeyProvider",
    "ExtentCipher",
    "KeyEncryptionKey",
    "KeyFileProvider",
    "KeyWrapper",
    "MasterKeyError",
    "MasterKeyProvider",
    "SealOpenError",
    "SegmentContext",
    "default_master_key_provider",
    "new_key",
    "new_salt",
]
