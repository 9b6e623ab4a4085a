"""Tables, verdicts, plots and BENCHMARKS.md for bench/peers/peers.py, all from measured data.

Nothing here holds a number of its own: every figure in BENCHMARKS.md comes from the run that
called :func:`build`. Ratios are of medians from the same run. Verdicts compare them with the
targets of the performance issue and say "meets" or "MISSES", never anything else.
"""

from __future__ import annotations

import datetime as dt
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent.parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

from _common import GB, tokens_label  # noqa: E402
from _common import min_med_max as mmm  # noqa: E402
from _plots import median_bars, pyplot, save_figure  # noqa: E402

# The targets (ratios of medians, measured at each size in one run).
TARGET_VS_LMCACHE = 1.0  # tenantkv encrypted load / LMCache load >= 1
TARGET_TTFL_VS_LMCACHE = 0.1  # tenantkv TTFL / LMCache TTFL <= 0.1
TARGET_FRESH_VS_OUT = 0.8  # fresh tensors kept / out= >= 0.8
TARGET_LOOKUP_MS = 2.0  # 128K-token lookup on SQLite
TARGET_P99_P50 = 3.0
TARGET_SLOWEST_SHARE = 0.5  # x a fair share (1/16)
# A timed load that fetched more than this share of the prefix from storage was partly a cold
# read (memory pressure evicted some of its files): its row and the ratios using it are flagged.
COLD_SHARE = 0.05

COLOURS = {
    "raw": "#8c8c8c",
    "encrypted-limit": "#1f77b4",
    "decrypt-ceiling": "#17becf",
    "lmcache": "#2ca02c",
    "safetensors": "#9467bd",
    "torch": "#8c564b",
    "tenantkv": "#ff7f0e",
}


def label(s: Any) -> str:
    return f"{s.name} [{s.note}]" if s.note else s.name


def gbps(s: Any, nbytes: int) -> list[float]:
    return [nbytes / x / GB for x in s.seconds]


def find(run: Any, group: str, startswith: str = "") -> list[Any]:
    return [s for s in run.systems if s.group == group and s.name.startswith(startswith)]


def verdict(ok: bool) -> str:
    return "meets" if ok else "MISSES"


def is_cold(s: Any, nbytes: int) -> bool:
    """Did any timed load of ``s`` fetch more than COLD_SHARE of the prefix from storage?"""
    return bool(s.cold_bytes) and max(s.cold_bytes) > COLD_SHARE * nbytes


def conditions(nbytes: int, *systems: Any) -> str:
    cold = [s.name for s in systems if is_cold(s, nbytes)]
    return "warm" if not cold else "COLD reads in " + " and ".join(cold)


# --------------------------------------------------------------------------- #
# Per-size tables
# --------------------------------------------------------------------------- #


def size_rows(run: Any) -> list[dict[str, Any]]:
    nbytes = run.shape.total_bytes
    lmc = find(run, "lmcache")[0]
    limit = find(run, "encrypted-limit")[0]
    lmc_med = statistics.median(gbps(lmc, nbytes))
    limit_med = statistics.median(gbps(limit, nbytes))
    rows = []
    for s in run.systems:
        lo, med, hi = mmm(gbps(s, nbytes))
        f_lo, f_med, f_hi = mmm([x * 1e3 for x in s.first_layer])
        rows.append(
            {
                "system": label(s),
                "group": s.group,
                "lazy": s.lazy,
                "ttfl_is_total": s.ttfl_is_total,
                "gbps": (lo, med, hi),
                "ttfl_ms": (f_lo, f_med, f_hi),
                "vs_lmcache": med / lmc_med,
                "vs_limit": med / limit_med,
                "cold_mb": statistics.median(s.cold_bytes) / 1e6 if s.cold_bytes else 0.0,
                "cold_mb_max": max(s.cold_bytes) / 1e6 if s.cold_bytes else 0.0,
                "seconds": list(s.seconds),
                "first_layer_s": list(s.first_layer),
            }
        )
    return rows


@dataclass(frozen=True)
class Target:
    """One target's verdict at one size: the ratio of medians decides it; ``rounds`` shows how
    the same ratio, round by round, spreads around it (a median on the line is no verdict to
    lean on)."""

    what: str
    ratio: float
    target: str
    verdict: str
    page_cache: str
    rounds: str


def round_values(run: Any, system: Any, values: list[float]) -> list[float]:
    """A baseline's ``values`` from the rounds in which ``system`` was timed (in its group's
    rounds when the systems were timed in groups, each group with the baseline in it), or []
    when they cannot be paired round by round."""
    count = len(system.seconds)
    if len(values) == count:
        return values
    keys = label(system)
    groups = [i for i, group in enumerate(run.groups or []) if keys in group]
    if len(groups) != 1 or len(values) != count * len(run.groups):
        return []
    start = groups[0] * count
    return values[start : start + count]


def per_round(ratios: Sequence[float], meets: Any) -> str:
    """``min-max, k of n rounds meet`` of the ratios of one round each."""
    if not ratios:
        return "-"
    met = sum(1 for r in ratios if meets(r))
    return f"{min(ratios):.3f}-{max(ratios):.3f}, {met} of {len(ratios)} meet"


def targets(run: Any) -> list[Target]:
    """Every target's verdict at one size (see :class:`Target`)."""
    nbytes = run.shape.total_bytes
    lmc = find(run, "lmcache")[0]
    lmc_ttfl = statistics.median(lmc.first_layer)
    out: list[Target] = []

    def round_ratios(s: Any, base: Any, values: Callable[[Any], list[float]]) -> list[float]:
        """``values(s) / values(base)`` round by round ([] where they cannot be paired)."""
        theirs = round_values(run, s, values(base))
        return [a / b for a, b in zip(values(s), theirs, strict=False)] if theirs else []

    def speed_target(what: str, s: Any, base: Any, goal: float, target: str) -> Target:
        """``s``'s median GB/s over ``base``'s, which must be at least ``goal``."""
        r = statistics.median(gbps(s, nbytes)) / statistics.median(gbps(base, nbytes))
        ratios = round_ratios(s, base, lambda system: gbps(system, nbytes))
        rounds = per_round(ratios, lambda x: x >= goal)
        return Target(what, r, target, verdict(r >= goal), conditions(nbytes, s, base), rounds)

    ceilings = find(run, "decrypt-ceiling")
    if ceilings:
        # Not a target of its own: the bound on the first one (the faster thread count). Below
        # 1, no encrypted load (which must also read) can reach LMCache's on this machine.
        ceiling = max(ceilings, key=lambda s: statistics.median(gbps(s, nbytes)))
        what = "bound: decrypt-only ceiling (no reads) / LMCache load"
        reachable = ">= 1 for the load target to be reachable"
        out.append(speed_target(what, ceiling, lmc, TARGET_VS_LMCACHE, reachable))
    tkv = find(run, "tenantkv")
    suites = sorted({s.name.split(",")[0] for s in tkv})
    for suite in suites:
        by_mode = {s.name.split(", ")[1]: s for s in tkv if s.name.split(",")[0] == suite}
        for mode, s in by_mode.items():
            what = f"{suite} {mode}: load / LMCache load"
            out.append(speed_target(what, s, lmc, TARGET_VS_LMCACHE, ">= 1"))
        for mode, s in by_mode.items():
            r = statistics.median(s.first_layer) / lmc_ttfl
            ratios = round_ratios(s, lmc, lambda system: system.first_layer)
            out.append(
                Target(
                    f"{suite} {mode}: TTFL / LMCache TTFL",
                    r,
                    "<= 0.1",
                    verdict(r <= TARGET_TTFL_VS_LMCACHE),
                    conditions(nbytes, s, lmc),
                    per_round(ratios, lambda x: x <= TARGET_TTFL_VS_LMCACHE),
                )
            )
        if "out=" in by_mode and "fresh kept" in by_mode:
            fresh, with_out = by_mode["fresh kept"], by_mode["out="]
            what = f"{suite}: fresh kept / out="
            out.append(speed_target(what, fresh, with_out, TARGET_FRESH_VS_OUT, ">= 0.8"))
    return out


def ceiling_scaling(run: Any) -> str:
    """A sentence on how decryption scaled with threads in this run, when the decrypt-only
    ceiling ran on one thread and on several."""
    nbytes = run.shape.total_bytes
    by_threads = {s.note: statistics.median(gbps(s, nbytes)) for s in find(run, "decrypt-ceiling")}
    if len(by_threads) < 2 or "1 thread" not in by_threads:
        return ""
    one = by_threads.pop("1 thread")
    note, many = max(by_threads.items(), key=lambda item: item[1])
    return (
        f"Decryption scaling: the decrypt-only ceiling ran {many:.2f} GB/s on {note} against"
        f" {one:.2f} on 1 thread ({many / one:.2f}x). `cryptography` releases the GIL inside"
        " each segment's `decrypt_into` (~7 us) and takes it back after; a second thread that"
        " must wait for the GIL sleeps, and the first takes it back before that thread wakes"
        " (a convoy), so threads of one process decrypt side by side only part of the time"
        " (docs/perf.md)."
    )


def format_size_table(run: Any) -> str:
    rows = size_rows(run)
    name_w = max(len("system"), *(len(r["system"]) for r in rows))
    header = (
        f"{'system':<{name_w}}  {'min GB/s':>8}  {'med GB/s':>8}  {'max GB/s':>8}  "
        f"{'TTFL ms':>8}  {'/LMCache':>8}  {'/limit':>6}  {'cold MB':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lo, med, hi = r["gbps"]
        flag = "  LAZY" if r["lazy"] else ""
        lines.append(
            f"{r['system']:<{name_w}}  {lo:>8.3f}  {med:>8.3f}  {hi:>8.3f}  "
            f"{r['ttfl_ms'][1]:>8.2f}  {r['vs_lmcache']:>8.3f}  {r['vs_limit']:>6.3f}  "
            f"{r['cold_mb_max']:>7.0f}{flag}"
        )
    return "\n".join(lines)


def print_size(run: Any) -> None:
    print()
    print(
        f"{tokens_label(run.shape.tokens)} tokens: {run.shape.total_bytes / 1e6:.1f} MB, "
        f"{len(run.systems[0].seconds)} rounds (median TTFL; ratios of median GB/s)"
    )
    print(format_size_table(run))
    for t in targets(run):
        print(
            f"  {t.what:<55} {t.ratio:>8.3f}  target {t.target:<6} {t.verdict:<6}  "
            f"{t.page_cache}  per round {t.rounds}"
        )
    scaling = ceiling_scaling(run)
    if scaling:
        print(f"  {scaling}")
    print(flush=True)


# --------------------------------------------------------------------------- #
# Plots
# --------------------------------------------------------------------------- #


def plot_loads(sizes: Sequence[dict[str, Any]], path: Path) -> None:
    """Throughput and TTFL per system and size, from the rows :func:`size_rows` made (or the
    same rows read back from peers.json). The x axis of throughput stops at 1.25x the fastest
    system that really copies bytes: the LAZY mmap and the zero-copy touch run off the scale,
    their medians written at the edge."""
    plt = pyplot()
    n_sys = len(sizes[0]["systems"])
    fig, axes = plt.subplots(len(sizes), 2, figsize=(17, 0.42 * n_sys * len(sizes) + 2.2))
    if len(sizes) == 1:
        axes = [axes]
    for row, size in enumerate(sizes):
        rows = size["systems"]
        cold_limit = COLD_SHARE * size["bytes"] / 1e6
        cold = [r.get("cold_mb_max", 0.0) > cold_limit for r in rows]
        names = [
            r["system"] + ("  (LAZY)" if r["lazy"] else "") + ("  (COLD reads)" if c else "")
            for r, c in zip(rows, cold, strict=True)
        ]
        y = list(range(len(rows)))[::-1]
        colours = [COLOURS.get(r["group"], "#333333") for r in rows]
        off_scale = [r["lazy"] or "zero-copy" in r["system"] for r in rows]
        real = [r["gbps"][2] for r, off in zip(rows, off_scale, strict=True) if not off]
        x_max = 1.25 * max(real) if real else None
        ax = axes[row][0]
        med = [r["gbps"][1] for r in rows]
        err = [
            [m - r["gbps"][0] for m, r in zip(med, rows, strict=True)],
            [r["gbps"][2] - m for m, r in zip(med, rows, strict=True)],
        ]
        ax.barh(y, med, xerr=err, color=colours, edgecolor="black", capsize=3)
        for yy, r, c in zip(y, rows, cold, strict=True):
            if r["lazy"] or c:
                ax.barh([yy], [r["gbps"][1]], color="none", edgecolor="red", hatch="//")
        if x_max is not None:
            ax.set_xlim(0, x_max)
        for yy, m, off in zip(y, med, off_scale, strict=True):
            at = min(m, x_max) if x_max is not None else m
            text = f"{m:.2f}" + (" (off scale)" if off and x_max is not None and m > x_max else "")
            ax.annotate(
                text,
                (at, yy),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
                ha="left" if at == m else "right",
            )
        ax.set_yticks(y, names, fontsize=7)
        ax.set_xlabel("load GB/s (median; bars = min/max); hatched: LAZY or cold reads")
        ax.set_title(
            f"{tokens_label(size['tokens'])} tokens x 61 layers: load throughput", fontsize=9
        )
        ax.grid(axis="x", alpha=0.3)
        ax = axes[row][1]
        med = [max(r["ttfl_ms"][1], 1e-3) for r in rows]
        err = [
            [m - max(r["ttfl_ms"][0], 1e-3) for m, r in zip(med, rows, strict=True)],
            [r["ttfl_ms"][2] - m for m, r in zip(med, rows, strict=True)],
        ]
        ax.barh(y, med, xerr=err, color=colours, edgecolor="black", capsize=3)
        ax.set_xscale("log")
        ax.set_yticks(y, ["" for _ in rows])
        ax.set_xlabel("time to first usable layer, ms (log; median, bars = min/max)")
        ax.set_title("time to first layer (LMCache, torch.load: whole load)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    save_figure(fig, path, dpi=110)


def plot_modes(runs: Sequence[Any], path: Path) -> None:
    """Median GB/s per system in each mode (min-max as error bars), one panel per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import modes as M

    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4.5), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        nbytes = run.shape.total_bytes
        names: list[str] = []
        for systems in run.systems.values():
            for s in systems:
                if s.name not in names:
                    names.append(s.name)
        width = 0.8 / max(1, len(run.systems))
        for k, (mode, systems) in enumerate(run.systems.items()):
            xs, meds, lo, hi = [], [], [], []
            for s in systems:
                g = sorted(nbytes / t / 1e9 for t in s.seconds)
                if not g:
                    continue
                med = statistics.median(g)
                xs.append(names.index(s.name) + k * width)
                meds.append(med)
                lo.append(med - g[0])
                hi.append(g[-1] - med)
            ax.bar(xs, meds, width, yerr=[lo, hi], label=M.MODE_TITLES[mode], capsize=3)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
        ax.set_xticklabels([n.replace(" ", "\n", 1) for n in names], fontsize=7)
        ax.set_ylabel("GB/s (median; bars min-max)")
        ax.set_title(f"{run.shape.tokens:,} tokens, {nbytes / 1e6:.0f} MB")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lookups(lookups: dict[str, list[float]], tokens: int, path: Path) -> None:
    plt = pyplot()
    names = list(lookups)
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.5))
    y = list(range(len(names)))[::-1]
    median_bars(ax, y, [lookups[n] for n in names], horizontal=True, color="#1f77b4")
    ax.axvline(
        TARGET_LOOKUP_MS, color="red", linestyle="--", label=f"target {TARGET_LOOKUP_MS:g} ms"
    )
    ax.set_yticks(y, names, fontsize=8)
    ax.set_xlabel("ms (median; bars = min/max)")
    ax.set_title(f"lookup of a {tokens:,}-token prompt, all hits", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def plot_tenants(tenants: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    reps = tenants["reps"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    n = len(reps[0]["shares"])
    width = 0.8 / len(reps)
    for i, r in enumerate(reps):
        a.bar(
            [t + i * width for t in range(n)],
            [s * n for s in r["shares"]],
            width,
            label=f"rep {i + 1}",
        )
    a.axhline(1.0, color="black", linewidth=0.8, label="fair share")
    a.axhline(TARGET_SLOWEST_SHARE, color="red", linestyle="--", label="target floor (0.5x fair)")
    a.set_xlabel("tenant")
    a.set_ylabel("share of bytes loaded / fair share")
    a.set_title(f"{n} tenants at once: each tenant's share", fontsize=9)
    a.legend(fontsize=7)
    p50 = [r["p50_ms"] for r in reps]
    p99 = [r["p99_ms"] for r in reps]
    x = list(range(len(reps)))
    b.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
    b.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
    b.set_xticks(x, [f"rep {i + 1}\n{r['aggregate_gbps']:.2f} GB/s" for i, r in enumerate(reps)])
    b.set_ylabel("per-load latency, ms")
    b.set_title("per-load latency and aggregate throughput", fontsize=9)
    b.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


# --------------------------------------------------------------------------- #
# BENCHMARKS.md
# --------------------------------------------------------------------------- #


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def f3(x: float) -> str:
    return f"{x:.3f}"


#: BENCHMARKS.md's sections from this line on are measured by other scripts (the engine
#: backends': bench/engines_sglang.py); a run keeps them after the tables it writes.
KEPT_MARKER = "<!-- kept by bench/peers/peers.py: sections measured by other scripts -->"


def kept_sections(path: Path) -> str:
    """The kept sections of the BENCHMARKS.md at ``path`` (from :data:`KEPT_MARKER` on)."""
    try:
        old = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""
    at = old.find(KEPT_MARKER)
    return "" if at < 0 else "\n" + old[at:]


def build(
    *,
    runs: Sequence[Any],
    lookups: dict[str, list[float]],
    modes: Sequence[Any] = (),
    tenants: dict[str, Any],
    info: dict[str, str],
    args: dict[str, Any],
    command: str,
    started: float,
    plots_dir: Path,
    benchmarks_path: Path,
) -> tuple[str, dict[str, Any]]:
    """Write the plots; return BENCHMARKS.md's text and the JSON data behind it."""
    plot_loads(
        [
            {"tokens": r.shape.tokens, "bytes": r.shape.total_bytes, "systems": size_rows(r)}
            for r in runs
        ],
        plots_dir / "loads.png",
    )
    plot_lookups(lookups, args["lookup_tokens"], plots_dir / "lookups.png")
    plot_tenants(tenants, plots_dir / "tenants.png")
    rel = os.path.relpath(plots_dir, benchmarks_path.parent)

    date = dt.datetime.fromtimestamp(started, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    minutes = (dt.datetime.now(dt.UTC).timestamp() - started) / 60
    md: list[str] = [
        "# Benchmarks: tenantkv against unencrypted peers",
        "",
        "Written by `bench/peers/peers.py` from one run on the machine below; rerun it to"
        " replace every figure (bench/peers/README.md). Only ratios carry over between machines."
        " The sections after the marker near the end come from other benchmarks, each with its"
        " command; peers.py keeps them.",
        "",
        f"- date: {date} (the run took {minutes:.1f} min)",
        f"- command: `{command}`",
        f"- rounds: {args['reps']} per size; one untimed, checked warm-up load per system first",
        "",
        "## Machine and versions",
        "",
        md_table(["", ""], [[k, str(v).replace("|", "/")] for k, v in info.items()]),
        "",
        "## How it is measured",
        "",
        "- A DeepSeek-V3-shaped prefix: 61 layers x T tokens x 576 bf16 values (1,152 B per token"
        " per layer; 8K tokens = 575.7 MB, 32K = 2,302.7 MB). GB/s = plaintext bytes / s,"
        " 1 GB = 1e9 B. Every system loads from files in a warm page cache (written just before,"
        " nothing dropped; at a size whose files do not fit in memory together, the systems run"
        " in groups, each warm in turn: that size's section says so) into CPU memory.",
        "- Order: a round times one load of every system; rounds alternate forward and backward"
        " through the systems, so drift in machine load falls on all alike and each system's"
        " average position is the middle (a backward round also starts with the files the page"
        " cache touched last). The order of every round is in peers.json.",
        "- Verification: after every timed load, untimed, every loaded byte is compared with the"
        " original (reused destinations are zeroed before each load, on one thread, so stale bytes"
        " cannot pass and no thread pool spins into the timed load);"
        " the untimed warm-up load of each system is checked the same way, and once per size a"
        " load with one flipped bit must fail the check (a positive control).",
        "- Time to first layer (TTFL): from the call until layer 0 is usable. LMCache's chunks"
        " (256 tokens x all layers) and torch.load's one file give layer 0 only when the whole"
        " load is done, so their TTFL is the load time.",
        "- tenantkv's namespaces keep the default 64-token blocks; the `256-token blocks` rows"
        " (default suite) use LMCache's chunk size, the peer's reuse granularity: a segment (one"
        " block of one layer, sealed and opened as one) is then 288 KiB instead of 72 KiB.",
        "- LAZY: safetensors' mmap returns mapped pages it never read; its GB/s is not a load."
        " The `+ touch every page` row reads one byte per 4 KiB page: the pages are then mapped"
        " from the page cache, zero-copy, but their bytes are still unread (private, read-only"
        " file pages, not the caller's memory). The `+ copy into caller buffers` row is what an"
        " engine does with them (vLLM's example connector copies the loaded tensors into its KV"
        " cache) and compares with tenantkv's `out=`.",
        "- Ratios are of medians from the same run: `/LMCache` = this system's median GB/s over"
        " LMCache's; `/limit` = over the encrypted limit's.",
        "- Warm cache check: `MB from storage` is the most any timed load of that system had"
        " fetched from storage (`/proc/self/io` read_bytes around the load, process-wide); 0"
        " means every byte came from the page cache. Above 0, memory pressure had evicted some"
        " of its files and that row is partly a cold read.",
        "",
    ]
    data: dict[str, Any] = {"info": info, "args": args, "command": command, "sizes": []}

    for run in runs:
        lab = tokens_label(run.shape.tokens)
        rows = size_rows(run)
        md += [
            f"## Load: {lab} tokens ({run.shape.total_bytes / 1e6:,.1f} MB)",
            "",
            f"Memory available before the timed rounds: {run.mem_available_gib:.1f} GiB.",
            "",
        ]
        if len(run.groups) > 1:
            groups = " ".join(
                f"Group {n + 1}: {', '.join(names)}." for n, names in enumerate(run.groups)
            )
            md += [
                f"Every system's files together exceed {run.page_cache_share:g} of that"
                " (`--page-cache-share`), so the systems ran in"
                f" {len(run.groups)} groups, each warmed by one checked load of each of its systems"
                " after the other groups' files were dropped from the page cache"
                " (`POSIX_FADV_DONTNEED`), then timed for the rounds; LMCache, the baseline, in"
                f" each. {groups}",
                "",
            ]
        table = []
        for r in rows:
            lo, med, hi = r["gbps"]
            t_lo, t_med, t_hi = r["ttfl_ms"]
            name = r["system"] + (" **LAZY**" if r["lazy"] else "")
            ttfl = f"{t_lo:.2f} / {t_med:.2f} / {t_hi:.2f}"
            if r["ttfl_is_total"]:
                ttfl += " (= load)"
            cold = f"{r['cold_mb_max']:.0f}"
            table.append(
                [name, f3(lo), f3(med), f3(hi), ttfl, f3(r["vs_lmcache"]), f3(r["vs_limit"]), cold]
            )
        md.append(
            md_table(
                [
                    "system",
                    "min GB/s",
                    "median GB/s",
                    "max GB/s",
                    "TTFL ms min / med / max",
                    "/LMCache",
                    "/limit",
                    "MB from storage (max)",
                ],
                table,
            )
        )
        md += [
            "",
            f"Targets at {lab} (ratios of medians; `per round`: the same ratio in each round,"
            " its range and how many rounds meet the target):",
            "",
        ]
        tg = targets(run)
        cold_rows = [s.name for s in run.systems if is_cold(s, run.shape.total_bytes)]
        if cold_rows:
            md += [
                f"**Not a warm page cache at {lab}:** timed loads of {len(cold_rows)} systems"
                f" fetched more than {COLD_SHARE:.0%} of the prefix from storage (column `MB from"
                f" storage`): {', '.join(cold_rows)}. This machine's memory did not hold every"
                " system's files at once (memory available before the rounds:"
                f" {run.mem_available_gib:.1f} GiB), so these rows and the ratios that use them"
                " measure partly cold reads, not the systems side by side. Rerun this size on a"
                " machine with more free memory.",
                "",
            ]
        md.append(
            md_table(
                ["ratio", "value", "target", "verdict", "page cache", "per round"],
                [[t.what, f3(t.ratio), t.target, t.verdict, t.page_cache, t.rounds] for t in tg],
            )
        )
        md.append("")
        scaling = ceiling_scaling(run)
        if scaling:
            md += [scaling, ""]
        data["sizes"].append(
            {
                "tokens": run.shape.tokens,
                "bytes": run.shape.total_bytes,
                "mem_available_gib": run.mem_available_gib,
                "groups": run.groups,
                "order": run.order,
                "systems": rows,
                "targets": [
                    {
                        "what": t.what,
                        "ratio": t.ratio,
                        "target": t.target,
                        "verdict": t.verdict,
                        "page_cache": t.page_cache,
                        "per_round": t.rounds,
                    }
                    for t in tg
                ],
            }
        )
    md += [f"![loads]({rel}/loads.png)", ""]

    # ---- warm, cold, just stored ---------------------------------------------------------------
    if modes:
        import modes as M

        md += [
            "## Warm, cold and just stored",
            "",
            "The same systems timed in three modes, side by side in one run (`modes.py`):"
            " **warm** (files in the page cache), **cold** (each system's files fsynced and"
            " dropped from the page cache, `POSIX_FADV_DONTNEED`, before each of its loads) and"
            " **just stored** (each round stores the prefix anew, untimed, then loads it at"
            " once). Rounds alternate forward and backward through the modes and the systems;"
            " every loaded byte is checked. tenantkv's warm and cold rows read a cache opened"
            " with `recent_writes_bytes=0` (the page cache's case, then the device's); its"
            " just-stored row a cache with the defaults (a ring of recent writes per tenant,"
            " sized from the memory available).",
            "",
        ]
        for mode_run in modes:
            md += [M.markdown(mode_run, md_table), ""]
        plot_modes(modes, plots_dir / "modes.png")
        md += [f"![modes]({rel}/modes.png)", ""]
        data["modes"] = [M.as_json(m) for m in modes]

    # ---- lookups ---------------------------------------------------------------------------
    lt = args["lookup_tokens"]
    tkv_name = next(n for n in lookups if n.startswith("tenantkv"))
    tkv_med = statistics.median(lookups[tkv_name])
    rows_l = []
    for name, ms in lookups.items():
        lo, med, hi = mmm(ms)
        rows_l.append([name, f"{lo:.2f}", f"{med:.2f}", f"{hi:.2f}", f3(tkv_med / med)])
    md += [
        f"## Lookup of a {lt:,}-token prompt ({lt // 64:,} blocks of 64, all hits)",
        "",
        f"{args['lookup_reps']} calls each after one untimed call (whose answer is checked)."
        " tenantkv: `ns.lookup` = keyed prefix keys + the index query (SQLite; the prompt stored"
        " in 8 steps with `start=`, a 1-layer layout since a lookup reads no KV). sha256 chain:"
        " vLLM's chained `hash_block_tokens` with sha256 over pickle, 64-token blocks, hashing"
        " only. LMCache: its `ChunkedTokenDatabase.process_tokens` (256-token chunks), alone and"
        " followed by `LocalDiskBackend.contains` for each chunk (its lookup).",
        "",
        md_table(["lookup", "min ms", "median ms", "max ms", "tenantkv / this"], rows_l),
        "",
        f"Target: tenantkv's {lt:,}-token lookup <= {TARGET_LOOKUP_MS:g} ms on SQLite: median"
        f" {tkv_med:.2f} ms, {verdict(tkv_med <= TARGET_LOOKUP_MS)}"
        + (" (smoke size, not the 128K target)" if lt != 131_072 else "")
        + ".",
        "",
        f"![lookups]({rel}/lookups.png)",
        "",
    ]
    data["lookups_ms"] = lookups

    # ---- tenants -----------------------------------------------------------------------------
    reps = tenants["reps"]
    n = len(reps[0]["shares"])
    rows_t = []
    for i, r in enumerate(reps):
        rows_t.append(
            [
                str(i + 1),
                f"{r['elapsed_s']:.2f}",
                str(r["loads"]),
                f3(r["aggregate_gbps"]),
                f"{r['p50_ms']:.1f}",
                f"{r['p99_ms']:.1f}",
                f"{r['p99_ms'] / r['p50_ms']:.2f}",
                f"{r['min_share'] * n:.2f}",
            ]
        )
    pooled = sorted(x for r in reps for lat in r["latencies_s"] for x in lat)
    p50 = pooled[max(0, -(-len(pooled) // 2) - 1)] * 1e3
    p99 = pooled[max(0, -(-len(pooled) * 99 // 100) - 1)] * 1e3
    ratio = p99 / p50
    share = min(r["min_share"] * n for r in reps)
    rows_t.append(
        [
            "all",
            f"{sum(r['elapsed_s'] for r in reps):.2f}",
            str(len(pooled)),
            f3(statistics.median([r["aggregate_gbps"] for r in reps])) + " (median)",
            f"{p50:.1f}",
            f"{p99:.1f}",
            f"{ratio:.2f}",
            f"{share:.2f} (lowest)",
        ]
    )
    md += [
        f"## {n} tenants loading at once through one process",
        "",
        f"One TenantKV (default suite), {n} tenants with one namespace each, each holding its own"
        f" {tenants['tokens']:,}-token prefix ({tenants['tokens'] * 61 * 1152 / 1e6:.1f} MB)."
        f" Per rep, {n} threads (one per tenant) load their prefix back to back into their own"
        f" `out=` buffers for {tenants['window_s']:g} s. Every load is checked cheaply (first and"
        " last row of every layer poisoned before, compared after, outside its latency); every"
        " tenant's buffers are compared in full after each window and after its first, untimed"
        " load. Aggregate = bytes received within the window (counted per layer) / window;"
        " share = a tenant's bytes received within the window / all tenants';"
        " fair share = 1/16.",
        "",
        md_table(
            [
                "rep",
                "window s",
                "loads",
                "aggregate GB/s",
                "p50 ms",
                "p99 ms",
                "p99/p50",
                "slowest share / fair",
            ],
            rows_t,
        ),
        "",
        md_table(
            ["target", "all reps", "target", "verdict"],
            [
                [
                    f"p99 / p50 of all {len(pooled)} loads",
                    f"{ratio:.2f}",
                    "<= 3",
                    verdict(ratio <= TARGET_P99_P50),
                ],
                [
                    "slowest tenant's share / fair share (lowest rep)",
                    f"{share:.2f}",
                    ">= 0.5",
                    verdict(share >= TARGET_SLOWEST_SHARE),
                ],
            ],
        ),
        "",
        f"![tenants]({rel}/tenants.png)",
        "",
    ]
    data["tenants"] = tenants
    return "\n".join(md), data
