"""Canonical bytes of audit records and signed objects: the one encoding every hash covers.

Everything hashed or signed is a JSON object encoded canonically, byte by byte:

* ``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
  allow_nan=False)`` then UTF-8: keys sorted by Unicode code point, no whitespace anywhere,
  non-ASCII characters written as themselves (UTF-8), except that ``"``, ``\\``, control
  characters below U+0020 (``\\n``, ``\\r``, ``\\t``, ``\\b``, ``\\f``, else ``\\u00xx``
  lowercase) and the three other characters ``str.splitlines()`` breaks lines at -- U+0085,
  U+2028, U+2029, written ``\\u0085``, ``\\u2028``, ``\\u2029`` -- are escaped, so an export
  line never contains a line break of any kind (records hashed before this escaping existed:
  see ``legacy_text``);
* integers in plain decimal; times are integers of microseconds since the Unix epoch
  (``time_us``), so no float formatting is ever hashed at the top level;
* ``null`` for an absent tenant (the system chain) or request id;
* ``details`` is a JSON object given by the caller; floats inside it are written by Python's
  shortest round-trip ``repr`` (prefer integers and strings there); NaN and infinities are refused.

A **record** body has exactly these keys (shown in their sorted order)::

    {"action":str,"actor":str,"chain":str,"details":{...},"outcome":str,"prev_hash":hex64,
     "request_id":str|null,"role":str,"seq":int,"target":str,"tenant":str|null,"time_us":int,
     "type":"record","v":1}

and ``hash = SHA-256(body bytes)`` as 64 lowercase hex digits. ``prev_hash`` is the ``hash`` of
record ``seq - 1`` of the same chain; the first record of a chain (``seq`` 1) has
``prev_hash = GENESIS_HASH`` (64 zeros, i.e. 32 zero bytes in hex).

A **line** of a JSON Lines export carries its hash or signature *after* the body, so a verifier in
any language can check it without re-encoding JSON::

    line = body[:-1] + ',"hash":"' + hash + '"}'            (records)
    line = body[:-1] + ',"signature":"' + sig_hex + '"}'    (checkpoints, export trailer)

i.e. the body with its closing brace replaced by one more member. To verify, cut the fixed-size
suffix off, put the ``}`` back, and hash (or check the Ed25519 signature of) exactly those bytes.
Any change to any byte of a line therefore changes what is hashed or signed.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from .errors import AuditRequestError

FORMAT_VERSION = 1
EXPORT_FORMAT_VERSION = 2
"""The version of what an export signs for itself: its per-chain checkpoint and its trailer.
2 added the edge proofs (``records.ExportCheckpoint``); records, stored checkpoints and purge
statements stay at ``FORMAT_VERSION``, so their hashes and signatures never change."""
GENESIS_HASH = "0" * 64
HASH_FIELD = "hash"
SIGNATURE_FIELD = "signature"
MAX_DETAILS_BYTES = 64 * 1024

# Line breaks for str.splitlines() that json.dumps leaves raw (it escapes everything below U+0020:
# \n \r \x0b \x0c \x1c \x1d \x1e). Escaping them keeps every export line one line however
# the file is split; they can only occur inside JSON strings, so a plain replace is exact.
_RAW_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_LINE_BREAK_CHARS = re.compile("[\x85\u2028\u2029]")
# An escape sequence in canonical JSON text: an escaped backslash is consumed as a pair, so the
# text `\\u2028` (a backslash, then "u2028") is never mistaken for an escaped U+2028.
_ESCAPES = re.compile(r"\\(\\|u0085|u2028|u2029)")

_SEALED_LINE = re.compile(r'\A(\{.*),"(hash|signature)":"([0-9a-f]+)"\}\Z', re.DOTALL)


def canonical_json(value: Any) -> bytes:
    """The canonical UTF-8 bytes of a JSON value (see the module docstring).

    Raises :class:`AuditRequestError` for values JSON cannot carry exactly (NaN, non-string keys
    that do not sort, lone surrogates that UTF-8 cannot encode).
    """
    try:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
        return escape_line_breaks(text).encode("utf-8")
    except (TypeError, ValueError) as err:  # UnicodeEncodeError is a ValueError
        raise AuditRequestError(f"value cannot be encoded as canonical JSON: {err}") from None


def escape_line_breaks(text: str) -> str:
    """``text`` (JSON) with U+0085, U+2028 and U+2029 written as ``\\uXXXX`` escapes.

    ``json.dumps`` escapes the other characters ``str.splitlines()`` splits at (all below
    U+0020) but writes these three raw, so a record holding one would fall apart into two
    "lines" for any reader that splits the way Python does (the docs allow
    ``verify_export(text.splitlines(), ...)``).
    """
    if _LINE_BREAK_CHARS.search(text) is None:
        return text
    return _LINE_BREAK_CHARS.sub(lambda m: _RAW_LINE_BREAKS[m.group(0)], text)


def legacy_text(text: str) -> str | None:
    """``text`` as older tenantkv encoded it (those three characters raw), or None if the same.

    Records written before the escaping was added were hashed over the raw characters; their
    export lines are now written escaped, so the verifier hashes this form as well when the
    escaped one does not match. Both encode the same JSON value, so nothing can be forged.
    """

    def unescape(match: re.Match[str]) -> str:
        escaped = match.group(1)
        return match.group(0) if escaped == "\\" else chr(int(escaped[1:], 16))

    legacy = _ESCAPES.sub(unescape, text)
    return None if legacy == text else legacy


def normalise_details(details: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``details`` as it will read back from the log (tuples become lists, and so on).

    Round-tripping through the canonical encoding once means the record we return, the row we
    store and every later export agree byte for byte.
    """
    if not isinstance(details, Mapping):
        raise AuditRequestError("details must be a mapping of string keys to JSON values")
    if not all(isinstance(key, str) for key in details):
        raise AuditRequestError("details keys must be strings")
    encoded = canonical_json(dict(details))
    if len(encoded) > MAX_DETAILS_BYTES:
        raise AuditRequestError(
            f"details take {len(encoded)} bytes encoded; the limit is {MAX_DETAILS_BYTES}"
        )
    decoded: dict[str, Any] = json.loads(encoded)
    return decoded


def to_microseconds(seconds: float) -> int:
    """Seconds since the epoch as the integer microseconds that records hash."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise AuditRequestError(f"a time must be a number of seconds, got {seconds!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise AuditRequestError(f"a time must be finite and not before 1970, got {seconds!r}")
    return round(seconds * 1_000_000)


def record_body(
    *,
    chain: str,
    seq: int,
    time_us: int,
    actor: str,
    role: str,
    tenant: str | None,
    action: str,
    target: str,
    outcome: str,
    request_id: str | None,
    details: Mapping[str, Any],
    prev_hash: str,
) -> dict[str, Any]:
    """The hashed object of one record (every field except its own hash)."""
    return {
        "action": action,
        "actor": actor,
        "chain": chain,
        "details": dict(details),
        "outcome": outcome,
        "prev_hash": prev_hash,
        "request_id": request_id,
        "role": role,
        "seq": seq,
        "target": target,
        "tenant": tenant,
        "time_us": time_us,
        "type": "record",
        "v": FORMAT_VERSION,
    }


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sealed_line(body: Mapping[str, Any], field: str, value_hex: str) -> str:
    """One export line: the canonical body with ``field`` appended as its last member."""
    text = canonical_json(dict(body)).decode("utf-8")
    return f'{text[:-1]},"{field}":"{value_hex}"}}'


def split_sealed_line(line: str) -> tuple[str, str, str] | None:
    """``(body text, field name, hex value)`` of an export line, or None if it has no seal."""
    match = _SEALED_LINE.match(line)
    if match is None:
        return None
    return match.group(1) + "}", match.group(2), match.group(3)
