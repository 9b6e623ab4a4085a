"""Terminal output of the demo: aligned tables and a progress bar that only a terminal sees."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A boxed table; columns after the first are right-aligned (they hold numbers)."""
    widths = [len(header) for header in headers]
    for row in rows:
        widths = [max(width, len(cell)) for width, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(width) if index == 0 else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  │ " + " │ ".join(parts) + " │"

    rule = "  ├─" + "─┼─".join("─" * width for width in widths) + "─┤"
    top = "  ┌─" + "─┬─".join("─" * width for width in widths) + "─┐"
    bottom = "  └─" + "─┴─".join("─" * width for width in widths) + "─┘"
    return "\n".join([top, line(headers), rule, *(line(row) for row in rows), bottom])


class ProgressBar:
    """``label [#####.....] done/total``, redrawn in place on a terminal, silent elsewhere.

    Piped output (logs, tests) gets only the lines the demo prints, not carriage-return noise.
    """

    def __init__(self, stream: TextIO, label: str, width: int = 24) -> None:
        self._stream = stream
        self._label = label
        self._width = width
        self._live = bool(getattr(stream, "isatty", lambda: False)())

    def __call__(self, done: int, total: int) -> None:
        if not self._live:
            return
        filled = self._width * done // total if total else self._width
        bar = "#" * filled + "." * (self._width - filled)
        self._stream.write(f"\r    {self._label} [{bar}] {done}/{total}")
        if done >= total:
            self._stream.write("\r" + " " * (len(self._label) + self._width + 20) + "\r")
        self._stream.flush()
