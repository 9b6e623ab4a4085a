"""Shared helpers for the tenantkv benchmarks: machine description, timing,
full-length positional I/O, result statistics, a fixed-width table and a plot.

Throughput is always plaintext bytes / second with 1 GB = 1e9 bytes.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

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


def machine_info(data_dir: str) -> dict[str, str]:
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


def format_ms_row(name: str, seconds: Sequence[float], name_w: int) -> str:
    ms = [s * 1e3 for s in seconds]
    return f"{name:<{name_w}}  {min(ms):>8.2f}  {statistics.median(ms):>10.2f}  {max(ms):>8.2f}"


_COLOURS = {"raw": "#8c8c8c", "aes-gcm": "#1f77b4", "tenantkv": "#ff7f0e"}


def plot_results(results: Sequence[Result], path: Path, title: str) -> None:
    """Bar chart of median GB/s with min/max error bars, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.name if r.threads is None else f"{r.name}\n({r.threads} thr)" for r in results]
    med = [r.median_gbps for r in results]
    err = [
        [m - r.min_gbps for m, r in zip(med, results, strict=True)],
        [r.max_gbps - m for m, r in zip(med, results, strict=True)],
    ]
    colours = [_COLOURS.get(r.group, "#2ca02c") for r in results]

    fig, ax = plt.subplots(figsize=(max(8.0, 1.35 * len(results)), 5.5))
    bars = ax.bar(range(len(results)), med, yerr=err, capsize=5, color=colours, edgecolor="black")
    for bar, value, r in zip(bars, med, results, strict=True):
        ax.annotate(  # the median, written just above the max whisker
            f"{value:.2f}",
            (bar.get_x() + bar.get_width() / 2, r.max_gbps),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(results)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, 1.1 * max(r.max_gbps for r in results))  # room for the labels
    ax.set_ylabel("GB/s (plaintext, 1 GB = 1e9 B); median, bars = min/max")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- #
# Generic min / median / max tables (added for streaming.py)
# --------------------------------------------------------------------------- #


def min_med_max(values: Sequence[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def median_bars(
    ax: Any,
    positions: Sequence[float],
    samples: Sequence[Sequence[float]],
    width: float,
    *,
    label: str,
    color: str | None = None,
) -> None:
    """One bar per sample at its median, with whiskers to its min and max (a grouped bar
    chart's series: one call per series, shifted by ``width``)."""
    medians = [statistics.median(values) for values in samples]
    errors = [
        [median - min(values) for median, values in zip(medians, samples, strict=True)],
        [max(values) - median for median, values in zip(medians, samples, strict=True)],
    ]
    ax.bar(
        positions,
        medians,
        width,
        yerr=errors,
        capsize=3,
        label=label,
        color=color,
        edgecolor="black",
    )


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
    cols = [f"min {unit}", f"median {unit}", f"max {unit}"]
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


def finish_ab(
    heading: str,
    verdicts: dict[str, dict[str, float]],
    out: Path,
    name: str,
    plot: Callable[[Path], None],
    results: Any,
) -> None:
    """The end of an A/B benchmark: print each label's ratios of medians under ``heading``,
    draw ``out/<name>.png`` with ``plot`` and write ``out/<name>.json``."""
    import json

    print(f"\n{heading}")
    for label, ratios in verdicts.items():
        print(f"  {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    out.mkdir(parents=True, exist_ok=True)
    plot(out / f"{name}.png")
    (out / f"{name}.json").write_text(
        json.dumps({"results": results, "ratios": verdicts}, indent=1)
    )
    print(f"\nwrote {out / name}.png and {name}.json")
