"""Points in time as operators write them: ``--since 7d`` on the CLI, ``?since=2026-12-01T00:00Z``
over HTTP, and the epoch seconds the admin API has always taken.

One parser for both edges, so the CLI and the API accept the same forms and refuse the same
mistakes with the same sentence (InvalidRequestError naming the value and the forms accepted).
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Final

from .errors import InvalidRequestError

#: Latest instant accepted (seconds since the epoch; year 5138), as the admin API always had.
MAX_TIME: Final = 1e11
_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT_SECONDS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
FORMS: Final = (
    "ISO 8601 (2026-12-01T00:00:00Z; no zone means UTC), epoch seconds, or a time ago such as "
    "90s, 30m, 12h, 7d, 2w"
)


def parse_duration(text: str) -> float:
    """Seconds in ``90s``, ``30m``, ``12h``, ``7d``, ``2w`` (InvalidRequestError otherwise)."""
    match = _RELATIVE.fullmatch(text.strip().lower())
    if match is None:
        raise InvalidRequestError(
            f"{text!r} is not a duration (a number and one of s, m, h, d, w: 30m, 12h, 7d)"
        )
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def parse_instant(text: str, now: float) -> float:
    """Seconds since the epoch of ``text``: epoch seconds, ISO 8601 (naive: UTC), or a time
    ago (``7d`` is ``now`` minus seven days). Refuses anything else, NaN, and instants before
    the epoch or after :data:`MAX_TIME`."""
    value = text.strip()
    seconds: float | None = None
    if re.fullmatch(r"\d+(\.\d+)?", value):
        seconds = float(value)
    elif _RELATIVE.fullmatch(value.lower()):
        seconds = now - parse_duration(value)
    else:
        try:
            parsed = datetime.fromisoformat(value.replace("z", "Z"))
        except ValueError:
            raise InvalidRequestError(f"{text!r} is not a point in time: use {FORMS}") from None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        seconds = parsed.timestamp()
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_TIME:
        raise InvalidRequestError(f"{text!r} is outside the times a cache records")
    return seconds


def iso(seconds: float | None) -> str | None:
    """``seconds`` since the epoch in ISO 8601, UTC, to the second (None stays None)."""
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
