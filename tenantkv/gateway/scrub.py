"""Removing identity-bearing fields from JSON bodies, both ways.

A client must not choose what selects a cache: vLLM's ``cache_salt`` partitions its GPU prefix
cache, ``kv_transfer_params`` carries the tenantkv assertion to the connector, and
``vllm_xargs`` / ``extra_args`` are where older engines read ``kv_transfer_params`` from. A
client may also nest them (``extra_body`` sent literally, a field inside a message), or spell
them differently (``Cache-Salt``, ``cacheSalt``). So every key, at any depth, whose name
normalised (lowercase, letters and digits only) contains one of the markers is removed,
with its whole value. The same pass cleans the upstream's answers, so nothing of tenantkv's
(``kv_transfer_params``, any ``tenantkv*`` field) reaches the client; ``usage`` passes.

The walk is iterative: a body nested as deep as the JSON parser allows cannot exhaust the stack
here.
"""

from __future__ import annotations

import functools
from typing import Any, Final

#: Substrings of normalised key names that mark an identity-bearing field.
MARKERS: Final = ("cachesalt", "kvtransfer", "vllmxargs", "extraargs", "tenantkv")


def _normalised(key: str) -> str:
    return "".join(ch for ch in key.lower() if ch.isalnum())


#: Key names up to this length have their answer remembered (longer ones are computed).
_CACHED_KEY_CHARS: Final = 64


def _bearing(key: str) -> bool:
    name = _normalised(key)
    return any(marker in name for marker in MARKERS)


#: Bodies repeat the same few names (``model``, ``messages``, ``choices``...) on every request,
#: so their answers are remembered; a client sending new names each time only churns a cache
#: bounded in entries and, through ``_CACHED_KEY_CHARS``, in memory.
_bearing_cached = functools.lru_cache(maxsize=4096)(_bearing)


def identity_bearing(key: object) -> bool:
    """Whether a JSON object key names an identity-bearing field (see the module)."""
    if not isinstance(key, str):
        return False
    return _bearing_cached(key) if len(key) <= _CACHED_KEY_CHARS else _bearing(key)


def scrub(value: Any) -> int:
    """Remove, in place, every identity-bearing key of every object inside ``value``; the
    number removed."""
    removed = 0
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in [k for k in node if identity_bearing(k)]:
                del node[key]
                removed += 1
            stack.extend(v for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, dict | list))
    return removed
