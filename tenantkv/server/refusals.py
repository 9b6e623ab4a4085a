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
so is the memory the counts take. The counting is shared with the engines' refused assertions
(``components/refusal_windows.py``).

A window is written when a refusal (or :meth:`RefusalLog.flush_due`, run periodically by the
app) finds it ended, and on shutdown (:meth:`RefusalLog.flush`). A refused call of an
*authenticated* caller (403/404) is still audited per request: it names a token an operator can
revoke.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from ..audit import ACCESS_REFUSED, DENIED, AuditEvent
from ..components.refusal_windows import OTHER, RefusalStats, RefusalWindow, RefusalWindows

if TYPE_CHECKING:
    from ..api import TenantKV

__all__ = ["OTHER_SOURCES", "RefusalLog", "RefusalStats"]

OTHER_SOURCES: Final = OTHER  # where refusals of sources past ``max_sources`` are counted
UNKNOWN_SOURCE: Final = "unknown"
MAX_SOURCE = 64  # characters of a source address kept (an IPv6 address takes at most 45)
MAX_TOKEN_IDS: Final = 8
UNAUTHENTICATED: Final = "unauthenticated"
ACTOR: Final = "anonymous"


class RefusalLog:
    """Counts refused authentications and writes them to the system audit chain per window.

    The counting is :class:`~tenantkv.components.refusal_windows.RefusalWindows` (the engines'
    refused assertions use it too), keyed by source address. Thread-safe: refusals arrive from
    the request threads; ``clock`` is the cache's (a fake one in tests moves the windows)."""

    def __init__(
        self,
        kv: TenantKV,
        *,
        window_seconds: float,
        max_sources: int,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if max_sources < 1:
            raise ValueError("max_sources must be at least 1")
        self._windows = RefusalWindows(
            lambda records: kv.audit.record(*records),  # one transaction per window
            self._records,
            window_seconds=window_seconds,
            max_keys=max_sources,
            clock=clock or kv.now,
            what="refused authentications",
            max_notes=MAX_TOKEN_IDS,
        )
        self.window_seconds = self._windows.window_seconds
        self.max_sources = max_sources

    def count(self, source: str | None, reason: str, token_id: str | None = None) -> None:
        """Count one refusal of ``source`` for ``reason``; write windows that have ended."""
        address = (source or UNKNOWN_SOURCE)[:MAX_SOURCE]
        if self._windows.count(address, reason, token_id):  # a window ended (or began)
            self._windows.flush_due()

    def flush_due(self) -> None:
        """Write the windows that have ended (the app runs this periodically)."""
        self._windows.flush_due()

    def flush(self) -> None:
        """Write every window, the current one included (on shutdown, and for tests)."""
        self._windows.flush()

    def stats(self) -> RefusalStats:
        return self._windows.stats()

    def _records(self, window: RefusalWindow) -> list[AuditEvent]:
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
                    **window.details(entry),
                    "token_ids": sorted(entry.notes),
                },
            )
            for address, entry in sorted(window.keys.items())
        ]
