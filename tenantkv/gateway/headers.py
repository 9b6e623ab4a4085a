"""Which request headers the gateway forwards: a fixed allow-list, clean values only.

Nothing that authenticates the client (its ``Authorization``, cookies) or could steer the
upstream (hop-by-hop headers, ``Host``, forwarding headers) goes upstream; only the few headers
below, and only when their value holds no control character (CR/LF would split a header line
in a server that does not check).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

#: Request headers copied upstream (lowercase).
FORWARDED: Final = frozenset({b"accept", b"user-agent", b"x-request-id"})
_MAX_VALUE: Final = 1024


def clean_value(value: bytes) -> bool:
    """A header value of printable ASCII (and tabs), of bounded length."""
    return len(value) <= _MAX_VALUE and all(b == 9 or 32 <= b < 127 for b in value)


def forwarded_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The allow-listed headers of a request whose values are clean."""
    out: dict[str, str] = {}
    for name, value in raw:
        key = name.lower()
        if key in FORWARDED and clean_value(value):
            out[key.decode("ascii")] = value.decode("ascii")
    out["content-type"] = "application/json"
    return out
