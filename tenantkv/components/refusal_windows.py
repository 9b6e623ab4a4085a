"""Refusals counted per time window and audited as a bounded number of records per window.

A refusal costs whoever provokes it nothing: an anonymous caller of the admin API sending bad
tokens, or a client of a serving engine sending requests without a valid tenant assertion.
Writing one audit record per refusal (each in a write transaction of its own) let one sender
write without bound, and queued every other writer -- every tenant's stores -- behind the index's
write lock and the system chain's head: 2,000 refused engine requests took 2,000 transactions of
1.2-1.7 ms each (spikes to 48 ms) on vLLM's scheduler thread.

So refusals are counted in memory per (window, key, reason), and each window ends in one record
per key, all written in one transaction: at most ``max_keys`` keys by name per window, the rest
folded into one :data:`OTHER` entry, and at most ``max_notes`` notes per key (the ids of revoked
tokens presented, say: worth keeping, and few). What is stored per window, and the memory the
counts take, are bounded whatever the traffic; nothing is lost: every refusal is in some
record's count. The caller decides what a key is (the admin API: the source address; the
engines: the kind of security event) and what the records say (:data:`RecordsOf`).

:class:`RefusalWindows` never writes from :meth:`RefusalWindows.count`; the caller writes ended
windows (:meth:`RefusalWindows.flush_due`) where it likes: the admin API on the request thread
or its periodic task, the engines on a :class:`WindowWriter` thread, so an engine's scheduler
never waits for the index.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..audit import AuditEvent

logger = logging.getLogger("tenantkv")

#: The key under which refusals past ``max_keys`` keys in a window are counted.
OTHER: Final = "other"
#: Notes kept per key and window by default.
MAX_NOTES: Final = 8
#: A window's writer wakes this long after the window's end (its clock and the wait's differ).
_WRITER_SLACK_S = 0.05


@dataclass
class KeyCounts:
    """The refusals of one key in one window: how many for each reason, and a few notes."""

    reasons: Counter[str] = field(default_factory=Counter)
    notes: set[str] = field(default_factory=set)

    @property
    def count(self) -> int:
        return sum(self.reasons.values())


@dataclass
class RefusalWindow:
    """The refusals counted from ``start`` for ``seconds``, by key."""

    start: float
    seconds: float
    keys: dict[str, KeyCounts] = field(default_factory=dict)

    def details(self, counts: KeyCounts) -> dict[str, Any]:
        """What every aggregate record of this window says of one key's refusals (the
        server and the engines add what names the key)."""
        return {
            "window_start": self.start,
            "window_seconds": self.seconds,
            "count": counts.count,
            "reasons": dict(sorted(counts.reasons.items())),
        }


@dataclass(frozen=True)
class RefusalStats:
    """What the metrics show: refusals by reason since start, how many of them were folded
    into :data:`OTHER`, the aggregate records written, and failed flushes."""

    refused: dict[str, int]
    folded: int
    records: int
    flush_errors: int


#: The audit records of an ended window, one per key (the caller's actor, action and details).
RecordsOf = Callable[[RefusalWindow], list[AuditEvent]]
#: Writes a window's records, all or none (one transaction).
WriteRecords = Callable[[Sequence[AuditEvent]], None]


class RefusalWindows:
    """Counts refusals per window and key; writes each ended window's records in one call.

    Thread-safe: refusals arrive from any thread. ``clock`` is the cache's (a fake one in tests
    moves the windows). A failed write is logged and counted (``on_flush_error`` is told too),
    never raised: a refusal must not turn into an error of its own."""

    def __init__(
        self,
        write: WriteRecords,
        records: RecordsOf,
        *,
        window_seconds: float,
        max_keys: int,
        clock: Callable[[], float],
        what: str,
        max_notes: int = MAX_NOTES,
        on_flush_error: Callable[[], None] | None = None,
    ) -> None:
        if not math.isfinite(window_seconds) or window_seconds <= 0:
            raise ValueError("window_seconds must be a positive number of seconds")
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self._write = write
        self._records_of = records
        self._clock = clock
        self._what = what
        self._on_flush_error = on_flush_error
        self.window_seconds = float(window_seconds)
        self.max_keys = max_keys
        self.max_notes = max_notes
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # windows are written in order, one flush at a time
        self._current: RefusalWindow | None = None
        self._ended: list[RefusalWindow] = []
        self._refused: Counter[str] = Counter()
        self._folded = 0
        self._records = 0
        self._flush_errors = 0

    def _roll(self, now: float) -> None:
        """End the current window if ``now`` is past it (under ``_lock``)."""
        current = self._current
        if current is not None and now >= current.start + self.window_seconds:
            self._ended.append(current)
            self._current = None

    def count(self, key: str, reason: str, note: str | None = None) -> bool:
        """Count one refusal of ``key`` for ``reason`` (keeping ``note``, within the bound).

        Writes nothing. True when the writer has news: a window ended and waits to be
        written, or this refusal began a window (whose end a writer may wait for)."""
        now = self._clock()
        with self._lock:
            self._roll(now)
            began = self._current is None
            if self._current is None:
                start = math.floor(now / self.window_seconds) * self.window_seconds
                self._current = RefusalWindow(start, self.window_seconds)
            keys = self._current.keys
            if key not in keys and len(keys) >= self.max_keys:
                key = OTHER
                self._folded += 1
            entry = keys.setdefault(key, KeyCounts())
            entry.reasons[reason] += 1
            if note is not None and len(entry.notes) < self.max_notes:
                entry.notes.add(note)
            self._refused[reason] += 1
            return began or bool(self._ended)

    def seconds_left(self) -> float | None:
        """Clock seconds until the current window ends (0 if it has), None without one."""
        with self._lock:
            if self._current is None:
                return None if not self._ended else 0.0
            return max(0.0, self._current.start + self.window_seconds - self._clock())

    def flush_due(self) -> None:
        """Write the windows that have ended."""
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
                records = self._records_of(window)
                try:
                    self._write(records)  # one transaction per window
                except Exception as err:  # logged and counted, never raised
                    logger.error(
                        "could not audit %d records of %s: %s", len(records), self._what, err
                    )
                    with self._lock:
                        self._flush_errors += 1
                    if self._on_flush_error is not None:
                        self._on_flush_error()
                    continue
                with self._lock:
                    self._records += len(records)


class WindowWriter:
    """Writes a :class:`RefusalWindows`' windows on a thread of its own, as they end.

    The thread starts with the first :meth:`wake` (a cache that refuses nothing runs none) and
    sleeps until the current window's end or the next wake. :meth:`close` stops it and writes
    what is left, the current window included, so closing loses no refusal."""

    def __init__(self, windows: RefusalWindows, *, name: str) -> None:
        self._windows = windows
        self._name = name
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def wake(self) -> None:
        """Tell the thread that a window began or ended (starting it if need be)."""
        with self._lock:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            left = self._windows.seconds_left()
            self._wake.wait(None if left is None else left + _WRITER_SLACK_S)
            self._wake.clear()
            if self._closed:
                return
            self._windows.flush_due()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and write every window (on the closing thread)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join(timeout)
        self._windows.flush()
