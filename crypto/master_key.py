"""The master key (key-encryption key, KEK) and where it comes from.

Data keys never touch disk in clear: they are wrapped by the KEK (envelope encryption) and the
wrapped form lives in the metadata database. The KEK itself comes from a provider:

* :class:`KeyFileProvider` -- a 32-byte random key in a file created with mode 0600 on first use
  (the embedded default, ``<root>/master.key``); a key file readable by group or others is refused.
* :class:`EnvKeyProvider` -- ``TENANTKV_MASTER_KEY``: 64 hex digits or urlsafe base64 of 32 bytes.
* anything else implementing :class:`KeyWrapper` (a KMS client that wraps and unwraps remotely).

Wrapped key format (``KeyEncryptionKey.wrap``), byte by byte::

    offset  size  field
    0       1     format version (1)
    1       1     cipher suite (1 = AES-256-GCM)
    2       12    random nonce
    14      n+16  AES-256-GCM(KEK, nonce, key, aad) -- ciphertext followed by the 16-byte tag

    aad = b"tenantkv/wrap/v1\\x00" || context

``context`` names what the key is for (tenant id, key version, purpose) so a wrapped key copied to
another row fails to open. Nonces are random: a KEK wraps a handful of keys per tenant, many orders
of magnitude below the 2**32 random-nonce limit NIST SP 800-38D sets per key.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import secrets
import stat
from pathlib import Path
from typing import Protocol, runtime_checkable

from cryptography.exceptions import InvalidTag

from .errors import MasterKeyError, SealOpenError
from .suites import KEY_BYTES, NONCE_BYTES, TAG_BYTES, CipherSuite

MASTER_KEY_ENV = "TENANTKV_MASTER_KEY"
_WRAP_VERSION = 1
_WRAP_AAD_PREFIX = b"tenantkv/wrap/v1\x00"
_WRAP_HEADER = 2 + NONCE_BYTES


@runtime_checkable
class KeyWrapper(Protocol):
    """Wraps and unwraps data keys; a KMS client can stand in for the local KEK."""

    def wrap(self, key: bytes, context: bytes) -> bytes:
        """Return an opaque blob that only :meth:`unwrap` with the same context opens."""
        ...

    def unwrap(self, blob: bytes, context: bytes) -> bytes:
        """Return the key; raise :class:`SealOpenError` for any blob that fails to open."""
        ...


class MasterKeyProvider(Protocol):
    """Supplies the 32 bytes of the master key."""

    def load(self) -> bytes:
        """Return the master key; raise :class:`MasterKeyError` when it cannot be had."""
        ...


class KeyEncryptionKey:
    """A local KEK: AES-256-GCM key wrapping with context-bound associated data."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise MasterKeyError(f"the master key must be {KEY_BYTES} bytes, got {len(key)}")
        self._aead = CipherSuite.AES_256_GCM.new_aead(key)

    def wrap(self, key: bytes, context: bytes) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, key, _WRAP_AAD_PREFIX + context)
        return bytes([_WRAP_VERSION, CipherSuite.AES_256_GCM]) + nonce + sealed

    def unwrap(self, blob: bytes, context: bytes) -> bytes:
        if len(blob) < _WRAP_HEADER + TAG_BYTES:
            raise SealOpenError("wrapped key is too short")
        if blob[0] != _WRAP_VERSION or blob[1] != CipherSuite.AES_256_GCM:
            raise SealOpenError("wrapped key has an unknown format")
        nonce = blob[2:_WRAP_HEADER]
        try:
            return self._aead.decrypt(nonce, blob[_WRAP_HEADER:], _WRAP_AAD_PREFIX + context)
        except InvalidTag:
            raise SealOpenError("wrapped key failed to open") from None


def parse_key_text(text: str) -> bytes:
    """Decode a 32-byte key written as 64 hex digits or (urlsafe) base64."""
    text = text.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    standard = text.replace("-", "+").replace("_", "/")  # accept urlsafe and standard alphabets
    try:
        key = base64.b64decode(standard + "=" * (-len(standard) % 4), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise MasterKeyError(f"a master key must be {KEY_BYTES} bytes as 64 hex digits or base64")
    return key


class EnvKeyProvider:
    """Reads the master key from an environment variable (default ``TENANTKV_MASTER_KEY``)."""

    def __init__(self, variable: str = MASTER_KEY_ENV) -> None:
        self.variable = variable

    def load(self) -> bytes:
        value = os.environ.get(self.variable)
        if not value:
            raise MasterKeyError(f"environment variable {self.variable} is not set")
        return parse_key_text(value)


class KeyFileProvider:
    """A master key kept in a file that only its owner may read, created on first use.

    Creation is exclusive (a 0600 temp file, fsynced, then hard-linked into place), so two processes
    starting at once agree on one key; an existing file that group or others can access is
    refused rather than silently trusted.
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = True) -> None:
        self.path = Path(path)
        self.create = create

    def load(self) -> bytes:
        try:
            return self._read()
        except FileNotFoundError:
            if not self.create:
                raise MasterKeyError(f"master key file {self.path} does not exist") from None
        with contextlib.suppress(FileExistsError):  # another process created it first: use it
            self._create()
        return self._read()

    def _read(self) -> bytes:
        try:
            return self._read_checked()
        except (FileNotFoundError, MasterKeyError):
            raise
        except OSError as err:
            raise MasterKeyError(f"master key file {self.path} cannot be read: {err}") from err

    def _read_checked(self) -> bytes:
        info = self.path.stat()
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise MasterKeyError(
                f"master key file {self.path} is accessible to group or others "
                f"(mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it"
            )
        try:
            text = self.path.read_text(encoding="ascii")
        except UnicodeDecodeError:
            raise MasterKeyError(f"master key file {self.path} is not a text key") from None
        if not text.strip():
            raise MasterKeyError(f"master key file {self.path} is empty")
        return parse_key_text(text)

    def _create(self) -> None:
        # Write a private temp file, then hard-link it into place: the link is atomic and fails
        # if the key already exists, so no reader ever sees a half-written key file.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, (secrets.token_hex(KEY_BYTES) + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, self.path)
        finally:
            temp.unlink()


def default_master_key_provider(
    key_file: str | os.PathLike[str], *, create: bool = True
) -> MasterKeyProvider:
    """The environment variable when it is set, else the key file (created on first use, unless
    ``create`` is False)."""
    if os.environ.get(MASTER_KEY_ENV):
        return EnvKeyProvider()
    return KeyFileProvider(key_file, create=create)
