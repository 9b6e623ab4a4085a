"""Tenant data keys and namespace hashing keys: creation, wrapping, and a cache of unwrapped keys.

Every key is random, wrapped by the master key (or a KMS) with a context naming its owner and
purpose, and stored wrapped in the index. Unwrapped keys are cached in memory only; a tenant's
entries are dropped when the tenant is deleted.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict

from ..crypto import CipherSuite, ExtentCipher, KeyWrapper, SegmentContext, new_key

_DEK_CONTEXT = b"tenantkv/dek\x00"
_NSK_CONTEXT = b"tenantkv/nsk\x00"
#: Extent ciphers kept for loads (least recently used dropped first): a few hundred bytes each.
EXTENT_CIPHERS_KEPT = 4096


def data_key_context(tenant_id: bytes, version: int) -> bytes:
    return _DEK_CONTEXT + tenant_id + struct.pack(">I", version)


def namespace_key_context(tenant_id: bytes, namespace_id: bytes) -> bytes:
    return _NSK_CONTEXT + tenant_id + namespace_id


class Keyring:
    """Wraps new keys and unwraps stored ones, caching the results."""

    def __init__(self, wrapper: KeyWrapper) -> None:
        self._wrapper = wrapper
        self._lock = threading.Lock()
        self._data_keys: dict[tuple[bytes, int], bytes] = {}
        self._namespace_keys: dict[bytes, bytes] = {}
        # (tenant, version, namespace, salt, suite) -> the extent's cipher. Derived from a clear
        # data key, so dropped whenever that key is (every method below that forgets keys).
        self._extent_ciphers: OrderedDict[tuple[bytes, int, bytes, bytes, int], ExtentCipher] = (
            OrderedDict()
        )
        self._revocations = 0

    @property
    def revocations(self) -> int:
        """How many times keys were forgotten (a deletion, a retirement, or another node's key
        change): running loads re-check their keys when it moves (``KeyGuard``)."""
        with self._lock:
            return self._revocations

    def new_data_key(self, tenant_id: bytes, version: int) -> bytes:
        """A fresh data key, returned wrapped (the clear key is cached for this process)."""
        key = new_key()
        wrapped = self._wrapper.wrap(key, data_key_context(tenant_id, version))
        with self._lock:
            self._data_keys[(tenant_id, version)] = key
        return wrapped

    def data_key(self, tenant_id: bytes, version: int, wrapped: bytes) -> bytes:
        """The clear data key; raises SealOpenError if ``wrapped`` does not open."""
        with self._lock:
            cached = self._data_keys.get((tenant_id, version))
        if cached is not None:
            return cached
        key = self._wrapper.unwrap(wrapped, data_key_context(tenant_id, version))
        with self._lock:
            self._data_keys[(tenant_id, version)] = key
        return key

    def extent_cipher(
        self,
        context: SegmentContext,
        wrapped: bytes,
        salt: bytes,
        suite: CipherSuite,
    ) -> ExtentCipher:
        """The cipher of a stored extent (sealed under ``context``'s data-key version, with
        ``salt``), kept for the next load of the same extent: deriving it (HKDF, a new AEAD
        object) cost ~0.05-0.1 ms per extent per load, before the first layer. It lives no
        longer than the clear data key it comes from."""
        key = (context.tenant_id, context.key_version, context.namespace_id, salt, int(suite))
        with self._lock:
            cipher = self._extent_ciphers.get(key)
            if cipher is not None:
                self._extent_ciphers.move_to_end(key)
                return cipher
        data_key = self.data_key(context.tenant_id, context.key_version, wrapped)
        cipher = ExtentCipher(data_key, salt, context, suite)
        with self._lock:
            # Only while the data key is still cached: a key forgotten meanwhile (a retirement
            # or deletion racing this load) leaves no cipher behind.
            if self._data_keys.get((context.tenant_id, context.key_version)) is data_key:
                self._extent_ciphers[key] = cipher
                while len(self._extent_ciphers) > EXTENT_CIPHERS_KEPT:
                    self._extent_ciphers.popitem(last=False)
        return cipher

    def _forget_ciphers(self, tenant_id: bytes, versions: list[int] | None = None) -> None:
        """Drop the kept extent ciphers of ``tenant_id`` (of ``versions`` only, if given);
        called with the lock held."""
        for key in [
            k
            for k in self._extent_ciphers
            if k[0] == tenant_id and (versions is None or k[1] in versions)
        ]:
            del self._extent_ciphers[key]

    def cached_extent_ciphers(self, tenant_id: bytes) -> int:
        """How many extent ciphers of ``tenant_id`` this process keeps."""
        with self._lock:
            return sum(1 for k in self._extent_ciphers if k[0] == tenant_id)

    def new_namespace_key(self, tenant_id: bytes, namespace_id: bytes) -> bytes:
        key = new_key()
        wrapped = self._wrapper.wrap(key, namespace_key_context(tenant_id, namespace_id))
        with self._lock:
            self._namespace_keys[namespace_id] = key
        return wrapped

    def namespace_key(self, tenant_id: bytes, namespace_id: bytes, wrapped: bytes) -> bytes:
        with self._lock:
            cached = self._namespace_keys.get(namespace_id)
        if cached is not None:
            return cached
        key = self._wrapper.unwrap(wrapped, namespace_key_context(tenant_id, namespace_id))
        with self._lock:
            self._namespace_keys[namespace_id] = key
        return key

    def forget_versions(self, tenant_id: bytes, versions: list[int]) -> None:
        """Drop cached clear data keys of retired versions."""
        with self._lock:
            self._revocations += 1
            for version in versions:
                self._data_keys.pop((tenant_id, version), None)
            self._forget_ciphers(tenant_id, versions)

    def clear(self) -> None:
        """Drop every cached clear key (another node changed some tenant's keys); keys are
        unwrapped again from the index on their next use."""
        with self._lock:
            self._revocations += 1
            self._data_keys.clear()
            self._namespace_keys.clear()
            self._extent_ciphers.clear()

    def cached_tenants(self) -> set[bytes]:
        """Tenants with a clear data key in this process's memory."""
        with self._lock:
            return {tenant_id for tenant_id, _version in self._data_keys}

    def forget_tenant(self, tenant_id: bytes, namespace_ids: list[bytes]) -> None:
        """Drop a tenant's cached clear keys (after its wrapped keys were destroyed)."""
        with self._lock:
            self._revocations += 1
            for key in [k for k in self._data_keys if k[0] == tenant_id]:
                del self._data_keys[key]
            self._forget_ciphers(tenant_id)
            for namespace_id in namespace_ids:
                self._namespace_keys.pop(namespace_id, None)
