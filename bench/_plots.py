"""Shared plotting for the benchmarks: matplotlib on the Agg backend, bars at the median with
whiskers to the min and max, the GB/s bar chart of :class:`_common.Result` rows, and saving.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import Result

_COLOURS = {"raw": "#8c8c8c", "aes-gcm": "#1f77b4", "tenantkv": "#ff7f0e"}


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 120) -> None:
    """Lay ``fig`` out, write it to ``path`` (its folder made if need be) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def whiskers(
    samples: Sequence[Sequence[float] | None],
) -> tuple[list[float], list[list[float]]]:
    """Each sample's median, and the error bars from it to the sample's min and max (as
    matplotlib's ``yerr`` / ``xerr`` take them). An empty or missing sample gives zeros."""
    medians: list[float] = []
    lows: list[float] = []
    highs: list[float] = []
    for values in samples:
        if not values:
            medians.append(0.0)
            lows.append(0.0)
            highs.append(0.0)
            continue
        median = statistics.median(values)
        medians.append(median)
        lows.append(median - min(values))
        highs.append(max(values) - median)
    return medians, [lows, highs]


def horizontal_bars(
    path: Path, samples: dict[str, list[float]], xlabel: str, title: str | None = None
) -> None:
    """One horizontal bar per named sample at its median, whiskers to its min and max, the first
    sample on top; written to ``path``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(samples)))
    medians, errors = whiskers(list(samples.values()))
    ax.barh(list(samples), medians, xerr=errors, color="#4878a8", capsize=3)
    ax.set_xlabel(xlabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.invert_yaxis()
    save_figure(fig, path)


def median_bars(
    ax: Any,
    positions: Sequence[Any],
    samples: Sequence[Sequence[float] | None],
    width: float = 0.8,
    *,
    horizontal: bool = False,
    capsize: float = 3,
    edgecolor: str | None = "black",
    **bar: Any,
) -> Any:
    """One bar per sample at its median, with whiskers to its min and max (a grouped bar
    chart's series: one call per series, shifted by ``width``); ``bar`` goes to ``ax.bar``
    (``ax.barh`` when ``horizontal``). Returns the bars."""
    medians, errors = whiskers(samples)
    if horizontal:
        return ax.barh(
            positions, medians, width, xerr=errors, capsize=capsize, edgecolor=edgecolor, **bar
        )
    return ax.bar(
        positions, medians, width, yerr=errors, capsize=capsize, edgecolor=edgecolor, **bar
    )


def plot_results(results: Sequence[Result], path: Path, title: str) -> None:
    """Bar chart of median GB/s with min/max error bars, one bar per method."""
    plt = pyplot()
    labels = [r.name if r.threads is None else f"{r.name}\n({r.threads} thr)" for r in results]
    colours = [_COLOURS.get(r.group, "#2ca02c") for r in results]
    fig, ax = plt.subplots(figsize=(max(8.0, 1.35 * len(results)), 5.5))
    bars = median_bars(ax, range(len(results)), [r.gbps for r in results], capsize=5, color=colours)
    for bar, r in zip(bars, results, strict=True):
        ax.annotate(  # the median, written just above the max whisker
            f"{r.median_gbps:.2f}",
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
    save_figure(fig, path)
