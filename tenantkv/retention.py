"""Retention classes: how long a tenant's cached prefixes of each kind are kept after last use.

Providers keep prefix caches for days (DeepSeek: ~3 days for agent traffic, ~7 for chat), so
retention is per tenant and per kind of traffic. An extent expires ``retention[kind]`` seconds
after it was last stored or loaded; expired extents are misses at once and are removed by GC.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from .errors import InvalidRequestError

DEFAULT_RETENTION: dict[str, float] = {"agent": 3 * 86400.0, "chat": 7 * 86400.0}
DEFAULT_KIND = "chat"
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*")
_KIND = re.compile(r"[a-z][a-z0-9_-]{0,63}")
MAX_RETENTION = 366 * 86400.0
# A tenant's retention is stored as JSON text in a column of this many characters (models.py):
# PostgreSQL refuses longer text where SQLite would keep it, so the limit is checked here.
MAX_RETENTION_TEXT = 1024
# At most this many classes per tenant, defaults included. Updates merge classes, so without a
# cap a tenant-admin could grow its map with every PATCH; restarting retention and recording a
# load's use each cover all classes in one statement, whose size this bounds. Short class names
# fit 32 classes in the column; long ones meet MAX_RETENTION_TEXT first (both refused here).
MAX_RETENTION_CLASSES = 32


def parse_duration(value: Any) -> float:
    """Seconds from ``"3d"``, ``"12h"``, ``"30m"``, ``"45s"``, ``"2w"`` or a number of seconds."""
    if isinstance(value, bool):
        raise InvalidRequestError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value)):
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    else:
        raise InvalidRequestError(f"{value!r} is not a duration (use e.g. '3d', '12h', 3600)")
    if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_RETENTION:
        raise InvalidRequestError(f"retention {value!r} must be more than 0 and at most 366 days")
    return seconds


def parse_retention(value: Mapping[str, Any] | None) -> dict[str, float]:
    """A retention map (class -> seconds); classes not given keep their defaults."""
    retention = dict(DEFAULT_RETENTION)
    if value is None:
        return retention
    if not isinstance(value, Mapping):
        raise InvalidRequestError("retention must map class names to durations")
    for kind, duration in value.items():
        check_kind(kind)
        retention[kind] = parse_duration(duration)
    return retention


def check_kind(kind: Any) -> str:
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        raise InvalidRequestError(
            f"retention class {kind!r} is invalid: lower-case letters, digits, '_' or '-'"
        )
    return kind


def dumps(retention: Mapping[str, float]) -> str:
    """The stored form of a tenant's whole retention map; every write of one comes here, so
    the limits on what a tenant may keep are checked here, before anything is changed."""
    if len(retention) > MAX_RETENTION_CLASSES:
        raise InvalidRequestError(
            f"retention of {len(retention)} classes is more than the {MAX_RETENTION_CLASSES} a "
            "tenant may have (the defaults count); set existing classes instead of adding more"
        )
    text = json.dumps(dict(sorted(retention.items())), separators=(",", ":"))
    if len(text) > MAX_RETENTION_TEXT:
        raise InvalidRequestError(
            f"retention of {len(retention)} classes takes {len(text)} characters, more than the "
            f"{MAX_RETENTION_TEXT} a tenant may have; use fewer or shorter class names"
        )
    return text


def loads(text: str) -> dict[str, float]:
    return {str(k): float(v) for k, v in json.loads(text).items()}
