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

Parsing is the expensive part, and most answers (every streamed token) hold no such key, so
:func:`may_bear` first looks at the raw JSON text: when it says False, no key of the parsed
value could be removed, so the text passes as it is. Its argument: in ASCII text without a
backslash, every JSON key is written literally, so its normalised name is a substring of the
whole text normalised the same way; a marker absent from the whole is absent from every key.
Anything else (non-ASCII, escapes, control bytes) goes to the parse.
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


#: Bytes the raw check accepts as they are: printable ASCII but the backslash (a JSON escape can
#: spell any character), and tab and LF (JSON whitespace; LF also ends an SSE line). Anything
#: else, CR and the other line separators of ``str.splitlines`` included, sends the text to
#: the parse.
_PLAIN: Final = bytes(b for b in range(32, 127) if b != ord("\\")) + b"\t\n"
#: ASCII letters lowered, as ``str.lower`` does for them.
_LOWER: Final = bytes.maketrans(
    bytes(range(ord("A"), ord("Z") + 1)), bytes(range(ord("a"), ord("z") + 1))
)
#: Bytes that normalisation drops (all but ASCII letters and digits, as ``str.isalnum`` keeps).
_NOT_ALNUM: Final = bytes(b for b in range(128) if not chr(b).isalnum())
_MARKER_BYTES: Final = tuple(marker.encode("ascii") for marker in MARKERS)


def may_bear(raw: bytes) -> bool:
    """Whether the JSON text ``raw`` could hold an identity-bearing key at any depth. False
    is a proof that :func:`scrub` of its parsed value removes nothing (see the module); True
    only means it must be parsed to know."""
    if raw.translate(None, _PLAIN):  # a byte outside the plain set
        return True
    name = raw.translate(_LOWER, _NOT_ALNUM)
    return any(marker in name for marker in _MARKER_BYTES)


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
