"""The command line every benchmark shares: its parser and common options, a script run again
as a child process with a hidden option, and the PNG + JSON it writes at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"
BLOCK_TOKENS = 64  # tenantkv's default block: sizes are whole blocks


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers (``8192,32768``)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of whole numbers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"not a list of positive numbers: {text!r}")
    return values


def block_sizes(text: str) -> list[int]:
    """argparse type: comma-separated token counts, each a positive multiple of 64."""
    values = int_list(text)
    if any(value % BLOCK_TOKENS for value in values):
        raise argparse.ArgumentTypeError(f"sizes must be multiples of {BLOCK_TOKENS}: {text!r}")
    return values


def bench_parser(
    doc: str | None,
    *,
    reps: int | None = None,
    layers: int | None = None,
    threads: bool = False,
    seed: int | None = None,
    data_dir: bool = True,
    out: bool = True,
) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc``, with the options most benchmarks
    take: ``--reps`` and ``--layers`` (given their defaults), ``--threads`` (default: the
    cores), ``--seed``, ``--dir`` (where the temporary data goes; default the system temp dir)
    and ``--out`` (where the PNG and JSON go; default bench/results)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    if reps is not None:
        parser.add_argument("--reps", type=int, default=reps, help=f"timed rounds ({reps})")
    if layers is not None:
        parser.add_argument("--layers", type=int, default=layers, help=f"layers ({layers})")
    if threads:
        parser.add_argument(
            "--threads",
            type=int,
            default=os.cpu_count() or 1,
            help="threads for the aes-gcm limit (default: cores)",
        )
    if seed is not None:
        parser.add_argument("--seed", type=int, default=seed)
    if data_dir:
        parser.add_argument(
            "--dir",
            type=Path,
            default=Path(tempfile.gettempdir()),
            help="parent of the temporary data (default: the system temp dir)",
        )
    if out:
        parser.add_argument(
            "--out", type=Path, default=RESULTS, help="where the PNG and JSON go (bench/results)"
        )
    return parser


def add_postgres(parser: argparse.ArgumentParser, skip: str | None = "--skip-postgres") -> None:
    """``--postgres URL`` (default ``$TENANTKV_TEST_POSTGRES_URL`` or the test server) and,
    unless ``skip`` is None, a flag of that name that runs on SQLite only."""
    from _fixtures import DEFAULT_POSTGRES

    parser.add_argument("--postgres", default=DEFAULT_POSTGRES, help="the PostgreSQL server")
    if skip is not None:
        parser.add_argument(skip, action="store_true", help="SQLite only")


def run_child(script: str | Path, flag: str, spec: Any, timeout: float | None = None) -> Any:
    """Run ``script`` again in a fresh interpreter with ``flag <spec as JSON>`` and return the
    JSON its last line of output holds (raises when it fails or times out)."""
    done = subprocess.run(
        [sys.executable, str(script), flag, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=BENCH_DIR,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"subprocess failed (rc {done.returncode}): {' | '.join(tail)}")
    return json.loads(lines[-1])


def write_outputs(
    out: Path,
    name: str,
    data: Any,
    plot: Callable[[Path], None] | None,
    *,
    indent: int = 2,
) -> tuple[Path, Path]:
    """``out/<name>.json`` (``data``) and ``out/<name>.png`` (drawn by ``plot``), then a line
    naming both."""
    out.mkdir(parents=True, exist_ok=True)
    png, js = out / f"{name}.png", out / f"{name}.json"
    js.write_text(json.dumps(data, indent=indent, default=str) + "\n", encoding="utf-8")
    if plot is not None:
        plot(png)
    print(f"\nwrote {png} and {js}")
    return png, js


def finish_ab(
    heading: str,
    verdicts: dict[str, dict[str, float]],
    out: Path,
    name: str,
    plot: Callable[[Path], None],
    results: Any,
) -> None:
    """The end of an A/B benchmark: print each label's ratios of medians under ``heading``,
    then write ``out/<name>.png`` (``plot``) and ``out/<name>.json``."""
    print(f"\n{heading}")
    for label, ratios in verdicts.items():
        print(f"  {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    write_outputs(out, name, {"results": results, "ratios": verdicts}, plot, indent=1)
