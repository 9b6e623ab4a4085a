"""What the engine integrations share besides the identity rule: the cache they open, and the
gateway keys they read from an engine's configuration.

The vLLM scheduler and worker sides (and an SGLang backend) in one process share one open cache
per root: one index connection pool, one set of loader threads, one staging ring. It is closed
when the process exits.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..api import TenantKV
from ..api import open as open_cache
from ..errors import InvalidRequestError

_caches: dict[str, TenantKV] = {}
_caches_lock = threading.Lock()


def shared_cache(root: str, open_options: Mapping[str, Any]) -> TenantKV:
    """One open cache per root in this process (later options for the same root are ignored)."""
    with _caches_lock:
        kv = _caches.get(root)
        if kv is None or kv.context.runtime.closed:
            kv = open_cache(root, **dict(open_options))
            _caches[root] = kv
        return kv


def open_caches() -> list[TenantKV]:
    """The caches this process's engine integrations opened (for tests and diagnostics)."""
    with _caches_lock:
        return list(_caches.values())


@atexit.register
def close_caches() -> None:
    """Close every shared cache (at exit; tests call it between engines)."""
    with _caches_lock:
        for kv in _caches.values():
            kv.close()
        _caches.clear()


def read_pems(keys: Any) -> tuple[bytes, ...]:
    """Gateway public keys from an engine's configuration: PEM texts or paths of PEM files.

    None or an empty list is refused: without keys no request could prove its tenant."""
    if isinstance(keys, str | bytes) or not isinstance(keys, Iterable):
        raise InvalidRequestError("gateway_public_keys must be a list of PEM texts or paths")
    pems = tuple(_read_pem(key) for key in keys)
    if not pems:
        raise InvalidRequestError(
            "gateway_public_keys is empty: without them no request could prove its tenant"
        )
    return pems


def _read_pem(key: Any) -> bytes:
    if isinstance(key, bytes):
        return key
    if isinstance(key, str) and "-----BEGIN" in key:
        return key.encode("ascii")
    if isinstance(key, str):
        return Path(key).read_bytes()
    raise InvalidRequestError("gateway_public_keys holds PEM texts or paths")
