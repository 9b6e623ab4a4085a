"""What the admin commands share: opening the cache, tables, ``--json``, sizes, progress bars.

Tables and bars are drawn by ``rich`` on stdout; ``--json`` prints one JSON document instead
(what scripts read), and errors go to stderr as one sentence (``main`` turns a TenantKVError
into ``tenantkv: <sentence>`` and exit 2). Nothing here imports the cache's data path: the
commands open the cache (and so import torch) only when they run, not for ``--help``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Any, Final

from ..audit import ROLE_OPERATOR, Attribution
from ..config import config_for_root, default_root
from ..errors import InvalidRequestError
from ..time_window import iso
from .audit import _actor

if TYPE_CHECKING:
    from rich.console import Console

    from ..api import TenantKV

_UNITS: Final = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?")


def console() -> Console:
    """stdout's console; a pipe or file gets wide lines (a table cut to 80 columns with
    ellipses would lose the ids a script or a ticket needs)."""
    from rich.console import Console

    width = None if sys.stdout.isatty() else 240
    return Console(highlight=False, soft_wrap=False, width=width)


@contextlib.contextmanager
def opened(root: str) -> Iterator[TenantKV]:
    """The existing cache at ``root`` (a mistyped root is refused, never created)."""
    from .. import open as open_cache

    with open_cache(config_for_root(root), create=False) as kv:
        yield kv


def operator() -> Attribution:
    """Who the CLI acts as in the audit log: the user running it, as an operator."""
    return Attribution(_actor(), ROLE_OPERATOR)


def add_root(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "root", nargs="?", default=default_root(), help="cache directory (default: $TENANTKV_ROOT)"
    )


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def plain(value: Any) -> Any:
    """``value`` as JSON can hold it (dataclasses as objects, tuples as lists)."""
    if is_dataclass(value) and not isinstance(value, type):
        return plain(asdict(value))
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def print_json(value: Any) -> None:
    print(json.dumps(plain(value), indent=2, sort_keys=True))


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A table on stdout; numeric columns right-aligned."""
    from rich.table import Table

    grid = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    numeric = [bool(rows) and all(_is_number(row[i]) for row in rows) for i in range(len(columns))]
    for name, right in zip(columns, numeric, strict=True):
        grid.add_column(name, justify="right" if right else "left", no_wrap=True)
    for row in rows:
        grid.add_row(*[_cell(value) for value in row])
    console().print(grid)


def fields(pairs: Sequence[tuple[str, Any]]) -> None:
    """A two-column ``name  value`` listing (one object)."""
    table(None, ["field", "value"], [(name, _cell(value)) for name, value in pairs])


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)) or value == "-"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def when(seconds: float | None) -> str:
    return iso(seconds) or "-"


def size(num_bytes: int) -> str:
    """Bytes for a person: 1.5 GiB."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_size(text: str) -> int:
    """Bytes in ``4096``, ``10GB``, ``1.5GiB``, ``512Mi`` (InvalidRequestError otherwise)."""
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None:
        raise InvalidRequestError(
            f"{text!r} is not a size (a number of bytes, or with a unit: 10GB, 1.5GiB, 512Mi)"
        )
    value = float(match.group(1)) * _UNITS[match.group(2) or ""]
    if value < 1 or value != int(value):
        raise InvalidRequestError(f"{text!r} is not a whole, positive number of bytes")
    return int(value)


def progress_bar(
    description: str, enabled: bool
) -> contextlib.AbstractContextManager[Callable[[int, int], None]]:
    """A context giving a ``(done, total)`` callback that draws a bar on stderr while it runs
    (nothing when ``enabled`` is False: ``--json``, or stderr not a terminal and not forced)."""
    return _Bar(description) if enabled else contextlib.nullcontext(_ignore)


def _ignore(done: int, total: int) -> None:
    del done, total


class _Bar:
    def __init__(self, description: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=Console(file=sys.stderr),
        )
        self._task = self._progress.add_task(description, total=None)

    def __enter__(self) -> Callable[[int, int], None]:
        self._progress.start()
        return self.update

    def update(self, done: int, total: int) -> None:
        if total == 0:  # nothing to do: a full bar, not an empty one
            done = total = 1
        self._progress.update(self._task, completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()
