"""Shared helpers for the tenantkv benchmarks: machine description, timing (one method, or
several round-robin), full-length positional I/O, result statistics and fixed-width tables.
Plots are in ``_plots.py``, the command line in ``_cli.py``, the data and caches in
``_fixtures.py``.

Throughput is always plaintext bytes / second with 1 GB = 1e9 bytes.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

try:
    import psutil  # type: ignore[import-untyped]
except ImportError:  # optional: only used to describe the machine
    psutil = None

GB = 1e9
MB = 1e6


# --------------------------------------------------------------------------- #
# Machine description
# --------------------------------------------------------------------------- #


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _filesystem_of(path: str) -> str:
    """Mount point, device and fs type holding `path` (fsync cost depends on it)."""
    if psutil is None:
        return "unknown"
    try:
        real = os.path.realpath(path)
        best = None
        for part in psutil.disk_partitions(all=True):
            mp = part.mountpoint
            inside = real == mp or real.startswith(mp.rstrip("/") + "/")
            if inside and (best is None or len(mp) > len(best.mountpoint)):
                best = part
        if best is not None:
            return f"{best.fstype} on {best.mountpoint} ({best.device})"
    except Exception:  # unusual platform: informational only
        pass
    return "unknown"


def _load_average() -> str:
    if not hasattr(os, "getloadavg"):
        return "unknown"
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min; other load skews multi-thread results)"


def machine_info(data_dir: str | Path) -> dict[str, str]:
    """What the numbers depend on: CPU, cores, library versions, filesystem."""
    cpu = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    flags = set((_cpuinfo_field("flags") or "").split())
    aes_flags = [f for f in ("aes", "vaes", "vpclmulqdq", "avx2", "avx512f") if f in flags]

    physical: int | None = None
    mem_total = "unknown"
    if psutil is not None:
        physical = psutil.cpu_count(logical=False)
        mem_total = f"{psutil.virtual_memory().total / 2**30:.1f} GiB"
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    cores = f"{os.cpu_count()} logical"
    if physical:
        cores += f", {physical} physical"
    if affinity is not None and affinity != os.cpu_count():
        cores += f", {affinity} usable by this process"

    try:
        from cryptography.hazmat.backends.openssl.backend import backend

        openssl = backend.openssl_version_text()
    except Exception:
        openssl = "unknown"

    try:
        import torch

        torch_version = str(torch.__version__)
    except Exception:
        torch_version = "not installed"

    return {
        "cpu": cpu,
        "cpu flags": " ".join(aes_flags) if flags else "unknown",
        "cores": cores,
        "memory": mem_total,
        "os": f"{platform.system()} {platform.release()}",
        "load average": _load_average(),
        "python": sys.version.split()[0],
        "torch": torch_version,
        "cryptography": f"{_version('cryptography')} ({openssl})",
        "data dir": f"{data_dir} [{_filesystem_of(data_dir)}]",
    }


def print_kv(title: str, items: dict[str, str]) -> None:
    width = max(len(k) for k in items)
    print(title)
    for key, value in items.items():
        print(f"  {key:<{width}}  {value}")
    print()


def print_machine(data_dir: str | Path, **extra: str) -> dict[str, str]:
    """Print what the numbers depend on (:func:`machine_info`, plus ``extra``); return it."""
    info = machine_info(str(data_dir)) | extra
    print_kv("Machine", info)
    return info


# --------------------------------------------------------------------------- #
# Timing
# --------------------------------------------------------------------------- #


def stopwatch(fn: Callable[[int], object]) -> Callable[[int], float]:
    """Wrap `fn(rep)` so that it returns its own wall time in seconds."""

    def measure(rep: int) -> float:
        t0 = time.perf_counter()
        fn(rep)
        return time.perf_counter() - t0

    return measure


def repeat(
    measure: Callable[[int], float],
    reps: int,
    *,
    before: Callable[[int], None] | None = None,
    after: Callable[[int], None] | None = None,
) -> list[float]:
    """Run `measure(rep)` `reps` times and collect the seconds it reports.

    `before` / `after` run outside the measurement (preparing fresh inputs,
    deleting files). The garbage collector is disabled while measuring.
    """
    seconds: list[float] = []
    for rep in range(reps):
        if before is not None:
            before(rep)
        gc.collect()
        gc.disable()
        try:
            seconds.append(measure(rep))
        finally:
            gc.enable()
        if after is not None:
            after(rep)
    return seconds


Hook = Callable[[int], None]


def round_robin(
    measures: Mapping[str, Callable[[int], float]],
    reps: int,
    *,
    before: Mapping[str, Hook | None] | None = None,
    after: Mapping[str, Hook | None] | None = None,
) -> dict[str, list[float]]:
    """``reps`` rounds, each measuring every method once in turn (:func:`repeat` of one, with
    the method's ``before`` / ``after`` hooks), so that drifting load on the machine falls on
    all of them alike; the seconds of each method, by name."""
    seconds: dict[str, list[float]] = {name: [] for name in measures}
    for _round in range(reps):
        for name, measure in measures.items():
            seconds[name] += repeat(
                measure,
                1,
                before=(before or {}).get(name),
                after=(after or {}).get(name),
            )
    return seconds


def round_robin_calls(
    calls: Mapping[str, Callable[[], object]],
    reps: int,
    *,
    setup: Mapping[str, Callable[[], None]] | None = None,
    freeze: bool = False,
) -> dict[str, list[float]]:
    """``reps`` rounds, each timing every call once in turn (``setup[name]`` runs untimed
    before its call); the seconds of each call, by name. The garbage collector stays on;
    with ``freeze`` every object made so far is moved out of its reach first
    (``gc.freeze()``), so that a collection triggered inside a timed call walks only new
    objects, as in a long-running server that freezes after start-up."""
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        for _round in range(reps):
            for name, call in calls.items():
                if setup is not None and name in setup:
                    setup[name]()
                started = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - started)
    finally:
        if freeze:
            gc.unfreeze()
    return seconds


# --------------------------------------------------------------------------- #
# Positional I/O that never returns short
# --------------------------------------------------------------------------- #


def preadv_full(fd: int, buf: memoryview, offset: int) -> None:
    """Fill `buf` from `offset` with one `os.preadv` (more only on a short read)."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise EOFError(f"unexpected end of file at offset {offset + done}")
        done += n


def pwrite_full(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], offset + done)


def write_full(fd: int, buf: memoryview) -> None:
    done = 0
    while done < len(buf):
        done += os.write(fd, buf[done:])


def publish(fd: int, tmp_path: Path, final_path: Path, dir_fd: int) -> None:
    """Finish an atomic store: fsync the file, close, rename into place, fsync the dir."""
    os.fsync(fd)
    os.close(fd)
    os.replace(tmp_path, final_path)
    os.fsync(dir_fd)


# --------------------------------------------------------------------------- #
# Results
# --------------------------------------------------------------------------- #


@dataclass
class Result:
    """One measured method: the plaintext bytes it moves and the time per rep."""

    name: str
    group: str  # "raw" | "aes-gcm" | "tenantkv" (plot colour)
    threads: int | None  # None: the method picks its own (tenantkv)
    nbytes: int
    seconds: list[float]

    @property
    def gbps(self) -> list[float]:
        return [self.nbytes / s / GB for s in self.seconds]

    @property
    def min_gbps(self) -> float:
        return min(self.gbps)

    @property
    def median_gbps(self) -> float:
        return statistics.median(self.gbps)

    @property
    def max_gbps(self) -> float:
        return max(self.gbps)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1e3

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "group": self.group,
            "threads": self.threads,
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "gbps": {"min": self.min_gbps, "median": self.median_gbps, "max": self.max_gbps},
        }


def format_table(results: Sequence[Result]) -> str:
    name_w = max(len("method"), *(len(r.name) for r in results))
    header = (
        f"{'method':<{name_w}}  {'thr':>3}  {'MB':>8}  "
        f"{'min GB/s':>9}  {'median GB/s':>11}  {'max GB/s':>9}  {'median ms':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.name:<{name_w}}  {r.threads or '-':>3}  {r.nbytes / MB:>8.1f}  "
            f"{r.min_gbps:>9.3f}  {r.median_gbps:>11.3f}  {r.max_gbps:>9.3f}  {r.median_ms:>10.1f}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# Generic min / median / max tables and ratios
# --------------------------------------------------------------------------- #


def min_med_max(values: Sequence[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def format_stats_table(
    rows: Sequence[tuple[str, Sequence[float], str]],
    unit: str,
    *,
    label: str = "metric",
    digits: int = 2,
    note_header: str = "",
) -> str:
    """A fixed-width table: one row per (name, values, note) with min / median / max of values."""
    name_w = max(len(label), *(len(name) for name, _, _ in rows))
    cols = [f"{stat} {unit}".rstrip() for stat in ("min", "median", "max")]
    col_w = max(9, digits + 7, *(len(c) for c in cols))
    header = f"{label:<{name_w}}  " + "  ".join(f"{c:>{col_w}}" for c in cols)
    if note_header:
        header += f"  {note_header}"
    lines = [header, "-" * len(header)]
    for name, values, note in rows:
        lo, mid, hi = min_med_max(values)
        cells = "  ".join(f"{v:>{col_w}.{digits}f}" for v in (lo, mid, hi))
        lines.append(f"{name:<{name_w}}  {cells}" + (f"  {note}" if note else ""))
    return "\n".join(lines)


def format_ratios(rows: Sequence[tuple[str, float, str]]) -> str:
    """Indented ``name  value  note`` lines (a NaN value shows as ``-``)."""
    name_w = max((len(name) for name, _, _ in rows), default=0)
    return "\n".join(
        f"  {name:<{name_w}}  {'     -' if value != value else f'{value:>6.3f}'}  {note}"
        for name, value, note in rows
    )


def tokens_label(tokens: int) -> str:
    """``8K`` for 8,192 tokens; the number where it is not whole thousands of 1,024."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)
