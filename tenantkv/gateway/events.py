"""Cleaning a stream of server-sent events as bytes, without parsing the events that cannot
hold an identity-bearing field.

The rule is the line-by-line one of :func:`streaming.scrub_event_line`: a ``data:`` line holding
JSON loses every identity-bearing key (:mod:`scrub`); every other line passes; lines are joined
by LF, and an event goes out when its blank line arrives. Parsing each streamed token's JSON
to find that nothing is to be removed was most of the gateway's cost per event, so this
cleaner works on whole events:

* the bytes are cut after the last ``LF LF`` received: at such a cut every line and every event
  before it is complete (the second LF ends an empty line, which ends the event), so what
  follows starts afresh, whatever chunking the upstream chose;
* a run of complete events for which :func:`scrub.may_bear` is False passes byte for byte: it
  holds no CR or other line separator (so its lines are exactly its LF-separated pieces, which
  the rule would join by LF again) and no JSON key in it can be removed (the proof is in
  :mod:`scrub`), so the rule would output the same bytes;
* any other run goes through the rule itself, line by line, as does what is left when the
  stream ends.

The output is therefore the rule's output, byte for byte, in the same order and no later than
it; tests/test_gateway_events.py checks that against the line-by-line path for random streams
split at random places. Only UTF-8 streams are cut as bytes (``LF LF`` is then never inside a
character); :class:`streaming.EventStream` sends any other charset through the line path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from .scrub import may_bear

_EVENT_END: Final = b"\n\n"


class EventCleaner:
    """Incremental: :meth:`feed` each upstream chunk, then :meth:`end` once; each returns the
    bytes to send now (possibly empty)."""

    def __init__(self, clean_line: Callable[[str], str]) -> None:
        self._clean_line = clean_line
        self._held = b""  # bytes after the last cut: an event not complete yet

    def feed(self, chunk: bytes) -> bytes:
        held = self._held + chunk
        # the cut can only be new if it ends in the new chunk: search from the old tail
        cut = held.rfind(_EVENT_END, max(0, len(self._held) - 1))
        if cut < 0:
            self._held = held
            return b""
        cut += len(_EVENT_END)
        ready, self._held = held[:cut], held[cut:]
        return self._clean(ready) if may_bear(ready) else ready

    def end(self) -> bytes:
        held, self._held = self._held, b""
        return self._clean(held) if held else b""

    def _clean(self, raw: bytes) -> bytes:
        """The line-by-line rule over ``raw`` (whole events, or the stream's last bytes)."""
        out: list[str] = []
        lines: list[str] = []
        for line in raw.decode("utf-8", "replace").splitlines():
            lines.append(self._clean_line(line))
            if not line:  # a blank line ends an event
                out.append("\n".join(lines) + "\n")
                lines.clear()
        if lines:  # only at the end of the stream: the rule closes the last event
            out.append("\n".join(lines) + "\n\n")
        return "".join(out).encode()
