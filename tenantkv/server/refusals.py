"""Refused authentications (401s), counted in memory and audited as one record per source and
time window.

An unauthenticated caller is not attributable: it can send as many bad tokens as its connection
carries. Writing one audit record per refusal (each in its own write transaction, with a request
id the caller chose, kept as long as the audit log keeps anything) let one connection write
gigabytes a day and queue every other writer behind the system chain's head. So refusals are
counted per (window, source address, reason) and each window ends in one ``access.refused``
record per source, written in one transaction: at most ``max_sources`` sources per window, the
rest folded into one ``other`` entry, and at most ``MAX_TOKEN_IDS`` ids of revoked or expired
tokens per source (those ids are worth keeping: a revoked token still in use is news). The
caller's request id is not kept. What is stored per window is bounded whatever the traffic, and
so is the memory the counts take.

A window is written when a refusal (or :meth:`RefusalLog.flush_due`, run periodically by the
app) finds it ended, and on shutdown (:meth:`RefusalLog.flush`). A refused call of an
*authenticated* caller (403/404) is still audited per request: it names a token an operator can
revoke.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from ..audit import ACCESS_REFUSED, DENIED, AuditEvent

if TYPE_CHECKING:
    from ..api import TenantKV

logger = logging.getLogger("tenantkv.server")

OTHER_SOURCES: Final = "other"  # where refusals of sources past ``max_sources`` are counted
UNKNOWN_SOURCE: Final = "unknown"
MAX_SOURCE = 64  # characters of a source address kept (an IPv6 address takes at most 45)
MAX_TOKEN_IDS: Final = 8
UNAUTHENTICATED: Final = "unauthenticated"
ACTOR: Final = "anonymous"


@dataclass
class _Source:
    """The refusals of one source in one window."""

    reasons: Counter[str] = field(default_factory=Counter)
    token_ids: set[str] = field(default_factory=set)


@dataclass
class _Window:
    start: float
    sources: dict[str, _Source] = field(default_factory=dict)


@dataclass(frozen=True)
class RefusalStats:
    """What the metrics show: refusals by reason since start, how many of them were folded
    into ``other``, the aggregate records written, and failed flushes."""

    refused: dict[str, int]
    folded: int
    records: int
    flush_errors: int


class RefusalLog:
    """Counts refused authentications and writes them to the system audit chain per window.

    Thread-safe: refusals arrive from the request threads; ``clock`` is the cache's (a fake one
    in tests moves the windows)."""

    def __init__(
        self,
        kv: TenantKV,
        *,
        window_seconds: float,
        max_sources: int,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not math.isfinite(window_seconds) or window_seconds <= 0:
            raise ValueError("window_seconds must be a positive number of seconds")
        if max_sources < 1:
            raise ValueError("max_sources must be at least 1")
        self._kv = kv
        self._clock = clock or kv.now
        self.window_seconds = float(window_seconds)
        self.max_sources = max_sources
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # windows are written in order, one flush at a time
        self._current: _Window | None = None
        self._ended: list[_Window] = []
        self._refused: Counter[str] = Counter()
        self._folded = 0
        self._records = 0
        self._flush_errors = 0

    def _window_start(self, now: float) -> float:
        return math.floor(now / self.window_seconds) * self.window_seconds

    def _roll(self, now: float) -> None:
        """End the current window if ``now`` is past it (under ``_lock``)."""
        current = self._current
        if current is not None and now >= current.start + self.window_seconds:
            self._ended.append(current)
            self._current = None

    def count(self, source: str | None, reason: str, token_id: str | None = None) -> None:
        """Count one refusal of ``source`` for ``reason``; write windows that have ended."""
        now = self._clock()
        address = (source or UNKNOWN_SOURCE)[:MAX_SOURCE]
        with self._lock:
            self._roll(now)
            if self._current is None:
                self._current = _Window(self._window_start(now))
            sources = self._current.sources
            if address not in sources and len(sources) >= self.max_sources:
                address = OTHER_SOURCES
                self._folded += 1
            entry = sources.setdefault(address, _Source())
            entry.reasons[reason] += 1
            if token_id is not None and len(entry.token_ids) < MAX_TOKEN_IDS:
                entry.token_ids.add(token_id)
            self._refused[reason] += 1
            due = bool(self._ended)
        if due:
            self.flush_due()

    def flush_due(self) -> None:
        """Write the windows that have ended (the app runs this periodically)."""
        with self._lock:
            self._roll(self._clock())
        self._write_ended()

    def flush(self) -> None:
        """Write every window, the current one included (on shutdown, and for tests)."""
        with self._lock:
            if self._current is not None:
                self._ended.append(self._current)
                self._current = None
        self._write_ended()

    def stats(self) -> RefusalStats:
        with self._lock:
            return RefusalStats(
                dict(self._refused), self._folded, self._records, self._flush_errors
            )

    def _write_ended(self) -> None:
        with self._flushing:
            with self._lock:
                windows, self._ended = self._ended, []
            for window in windows:
                events = list(self._events(window))
                try:
                    self._kv.audit.record(*events)  # one transaction per window
                except Exception as err:  # never turn a refusal into a 500; logged and counted
                    logger.error("could not audit %d refused authentications: %s", len(events), err)
                    with self._lock:
                        self._flush_errors += 1
                    continue
                with self._lock:
                    self._records += len(events)

    def _events(self, window: _Window) -> list[AuditEvent]:
        return [
            AuditEvent(
                actor=ACTOR,
                role=UNAUTHENTICATED,
                tenant=None,
                action=ACCESS_REFUSED,
                target="authentication",
                outcome=DENIED,
                details={
                    "source": address,
                    "window_start": window.start,
                    "window_seconds": self.window_seconds,
                    "count": sum(entry.reasons.values()),
                    "reasons": dict(sorted(entry.reasons.items())),
                    "token_ids": sorted(entry.token_ids),
                },
            )
            for address, entry in sorted(window.sources.items())
        ]
