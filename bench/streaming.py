#!/usr/bin/env python3
"""Layer-by-layer streaming load of tenantkv: throughput, time to first layer, peak RSS.

For each prefix size (``--tokens``, default 8,192 and 32,768 tokens) of a 61-layer
DeepSeek-V3-shaped prefix (MLA: 512 + 64 = 576 bf16 values = 1,152 B per token per
layer), in one run (warm page cache throughout, nothing is dropped; throughput is
*plaintext* bytes / second, 1 GB = 1e9 B):

1. Load throughput, every method timed in the same rounds (round-robin, one rep of
   each method per round, so machine noise hits all of them alike):

   * raw load -- unencrypted, layer-major file, one ``os.preadv`` per layer into
     preallocated buffers, 1 thread (``store_load.raw_load``);
   * aes-gcm load -- the "encrypted limit": the same bytes sealed per 64-token
     segment with AES-256-GCM, one ``preadv`` per layer, ``decrypt_into``
     preallocated buffers, one thread per core (``store_load.aes_load`` on a
     ``store_load.LayerWorkers`` pool);
   * tenantkv load, fresh tensors -- ``with ns.load(tokens) as s: for i, layer in s: pass``;
   * tenantkv load, caller buffers -- ``ns.load(tokens, out=bufs)`` into 61 tensors
     ``torch.empty(n, 576, dtype=torch.bfloat16)`` preallocated once, untimed.
     Skipped with a message if this tenantkv's ``load`` has no ``out=``.

   The baselines decrypt / read into the same preallocated ``bufs`` memory that the
   ``out=`` mode uses, so every preallocated-destination method writes into the same
   already-faulted pages. Ratios of medians: tenantkv / aes-gcm limit (target >= 0.9)
   and tenantkv / raw.

2. Time to first layer (TTFL: from calling ``ns.load`` to receiving layer 0) and total
   time (to receiving layer L-1), per rep; TTFL / (total / L) (target <= 3) and TTFL
   (target <= 10 ms).

3. Peak RSS growth of one load, in a fresh subprocess per size and mode: it opens the
   cache the prefix was stored in, looks the prefix up, (``out=`` mode: allocates and
   zero-fills the buffers, so their pages are resident before the baseline), runs
   ``gc.collect()``, starts a sampler thread reading ``psutil.Process().memory_info().rss``
   every ``--rss-interval-ms`` (1 ms), takes the baseline, then does one load iterating
   all layers and dropping each. Peak growth = highest sample during the load - baseline.
   VmHWM (``/proc/self/status``) is read before and after as a cross-check: when it rose
   during the load, it is the exact peak. Target: flat in the prefix size, within the
   staging ring (64 MiB by default) + the layers in flight (window = max(2, cores) ready
   ahead of the caller, plus the current and the previous one its loop variable holds;
   +16 MiB slack for the
   interpreter, threads and SQLite).

Each prefix is stored once (untimed) before its loads, and every method's output is
checked once (untimed) to equal the stored bytes; ``out=`` mode also checks that each
yielded layer *is* the caller's buffer (same storage). Data lives in a temporary
directory under ``--dir`` (default: the system temp dir), removed after each size.

Run:  .venv/bin/python bench/streaming.py [--tokens 8192,32768] [--reps 5]
      [--layers 61] [--threads N] [--dir /tmp] [--out bench/results]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from _cli import bench_parser, block_sizes, run_child, write_outputs
from _common import (
    GB,
    MB,
    Result,
    format_ratios,
    format_stats_table,
    print_kv,
    print_machine,
    round_robin,
    stopwatch,
    tokens_label,
)
from _fixtures import (
    BLOCK_TOKENS,
    DTYPE,
    VALUES_PER_TOKEN,
    byte_view,
    check_load,
    deepseek_layout,
    import_tenantkv,
    prefix_tokens,
    same_bits,
    tenant_namespace,
    timed_load,
)
from _plots import pyplot, save_figure, whiskers
from store_load import (
    TAG_BYTES,
    LayerWorkers,
    SegmentCipher,
    Shape,
    aes_load,
    aes_store,
    aesgcm_releases_gil,
    make_plaintext,
    raw_load,
    raw_store,
    split,
)

MiB = 2**20

THROUGHPUT_TARGET = 0.9  # tenantkv load / aes-gcm load limit
TTFL_RATIO_TARGET = 3.0  # TTFL <= 3/L of the total
TTFL_ABS_TARGET_MS = 10.0
DEFAULT_RING_BYTES = 64 * MiB  # tenantkv's staging ring default, if it does not say
# tenantkv keeps `window` = max(2, cores) fresh layers ready ahead of the caller; the caller's
# loop variable holds the current layer, and the previous one until the next arrives.
IN_FLIGHT_LAYERS = max(2, os.cpu_count() or 1) + 2
RSS_SLACK_BYTES = 16 * MiB

MODES = ("fresh", "out")
MODE_LABEL = {"fresh": "tenantkv load (fresh tensors)", "out": "tenantkv load (out= buffers)"}


# --------------------------------------------------------------------------- #
# Shared bits
# --------------------------------------------------------------------------- #


def ring_bytes(tenantkv: ModuleType) -> tuple[int, str]:
    """The staging ring size the RSS bound uses, and where it came from."""
    try:
        staging = importlib.import_module("tenantkv.datapath.staging")
        value = int(staging.DEFAULT_RING_BYTES)
        return value, "tenantkv.datapath.staging.DEFAULT_RING_BYTES"
    except Exception:
        return DEFAULT_RING_BYTES, "assumed default (tenantkv.datapath.staging not found)"


def new_buffers(layers: int, rows: int) -> list[torch.Tensor]:
    """Caller-owned output buffers, zero-filled so every page is resident before use."""
    return [torch.empty(rows, VALUES_PER_TOKEN, dtype=DTYPE).zero_() for _ in range(layers)]


class OutUnsupported(Exception):
    """tenantkv's load rejected out= (TypeError), or out= mode failed its checks."""


def call_load(ns: Any, hit: list[int], out: list[torch.Tensor] | None) -> Any:
    if out is None:
        return ns.load(hit, device="cpu")
    try:
        return ns.load(hit, device="cpu", out=out)
    except TypeError as err:
        raise OutUnsupported(f"ns.load(..., out=bufs) raised TypeError: {err}") from err


# --------------------------------------------------------------------------- #
# RSS subprocess
# --------------------------------------------------------------------------- #


def _vm_hwm() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class RssSampler(threading.Thread):
    """Reads this process's RSS every `interval` seconds into (time, rss) samples."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        import psutil  # type: ignore[import-untyped]

        self.interval = interval
        self.process = psutil.Process()
        self.samples: list[tuple[float, int]] = []
        self.halt = threading.Event()

    def rss(self) -> int:
        return int(self.process.memory_info().rss)

    def run(self) -> None:
        while not self.halt.is_set():
            self.samples.append((time.perf_counter(), self.rss()))
            time.sleep(self.interval)

    def stop(self) -> None:
        self.halt.set()
        self.join()


def rss_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One load in this (fresh) process; returns RSS figures in bytes."""
    tenantkv = import_tenantkv()
    layers, mode = spec["layers"], spec["mode"]
    tokens = prefix_tokens(spec["seed"], spec["tokens"])
    result: dict[str, Any] = {"mode": mode, "tokens": spec["tokens"]}
    with tenantkv.open(spec["root"]) as kv:
        ns = kv.namespace("bench", model="deepseek-v3", layout=deepseek_layout(layers))
        n = ns.lookup(tokens)
        if n != spec["tokens"]:
            raise RuntimeError(f"rss child: lookup found {n} of {spec['tokens']} tokens")
        hit = tokens[:n]
        bufs = new_buffers(layers, n) if mode == "out" else None
        gc.collect()
        sampler = RssSampler(spec["interval"])
        sampler.start()
        time.sleep(0.02)  # the sampler thread is running (its stack is in the baseline)
        hwm_before = _vm_hwm()
        baseline = sampler.rss()
        t0 = time.perf_counter()
        received = 0
        try:
            with call_load(ns, hit, bufs) as stream:
                for _index, layer in stream:
                    received += 1
                    del layer  # drop each layer as soon as it is received
            t1 = time.perf_counter()
            last = sampler.rss()
        except OutUnsupported as err:
            return result | {"error": str(err)}
        finally:
            sampler.stop()
        hwm_after = _vm_hwm()
        during = [rss for t, rss in sampler.samples if t0 <= t <= t1] + [last]
        if received != layers:
            raise RuntimeError(f"rss child: load yielded {received} layers, expected {layers}")
        result |= {
            "baseline": baseline,
            "peak": max(during),
            "growth": max(during) - baseline,
            "after": last - baseline,
            "samples": len(during),
            "load_seconds": t1 - t0,
            "hwm_growth": (
                hwm_after - baseline
                if hwm_before is not None and hwm_after is not None and hwm_after > hwm_before
                else None
            ),
        }
        del bufs
    return result


def run_rss_child(spec: dict[str, Any]) -> dict[str, Any]:
    try:
        return dict(run_child(__file__, "--rss-child", spec, timeout=300))
    except Exception as err:  # reported in its row, the run goes on
        return {"mode": spec["mode"], "tokens": spec["tokens"], "error": str(err)}


# --------------------------------------------------------------------------- #
# One prefix size
# --------------------------------------------------------------------------- #


@dataclass
class ModeResult:
    load: Result
    first_layer: list[float]  # seconds from calling ns.load to receiving layer 0, per rep
    layers: int

    @property
    def ttfl_ratio(self) -> list[float]:
        """TTFL / (total / L) per rep."""
        return [
            f / (t / self.layers) for f, t in zip(self.first_layer, self.load.seconds, strict=True)
        ]


@dataclass
class SizeResult:
    shape: Shape
    raw: Result
    aes: Result
    modes: dict[str, ModeResult] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # mode -> why
    rss: dict[str, dict[str, Any]] = field(default_factory=dict)


def verify_buffers(name: str, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not same_bits(g, w)]
    if bad:
        raise AssertionError(f"{name}: bytes differ from the original in layers {bad[:8]}")


def bench_size(
    tenantkv: ModuleType,
    shape: Shape,
    workdir: Path,
    reps: int,
    threads: int,
    seed: int,
    rss_interval: float,
    skip_rss: bool,
) -> SizeResult:
    """Everything for one prefix size; `workdir` is the caller's to remove afterwards."""
    t_start = time.perf_counter()
    # In-process part in its own function: its data and buffers are freed when it returns.
    size = measure_loads(tenantkv, shape, workdir, reps, threads, seed)
    gc.collect()

    # ---- peak RSS: one load per mode in a fresh subprocess ------------------------------------
    if not skip_rss:
        print(f"[{shape.tokens} tokens] peak RSS (fresh subprocess per mode) ...", flush=True)
        for mode in MODES:
            spec = {
                "root": str(workdir / "tenantkv"),
                "tokens": shape.tokens,
                "layers": shape.layers,
                "seed": seed,
                "mode": mode,
                "interval": rss_interval,
            }
            size.rss[mode] = run_rss_child(spec)
    print(f"[{shape.tokens} tokens] done in {time.perf_counter() - t_start:.0f} s", flush=True)
    return size


def measure_loads(
    tenantkv: ModuleType, shape: Shape, workdir: Path, reps: int, threads: int, seed: int
) -> SizeResult:
    """Store once (untimed), check every method once (untimed), then time the loads."""
    print(f"[{shape.tokens} tokens] generating {shape.total_bytes / MB:.0f} MB ...", flush=True)
    plain = make_plaintext(shape, seed)
    want = [
        torch.frombuffer(buf, dtype=DTYPE).view(shape.tokens, shape.values_per_token)
        for buf in plain
    ]
    tokens = prefix_tokens(seed, shape.tokens)
    bufs = new_buffers(shape.layers, shape.tokens)  # shared by baselines and out= mode
    dst_views = [byte_view(b) for b in bufs]
    dst_segments = [split(v, shape.pt_spans) for v in dst_views]

    def zero_bufs() -> None:
        for b in bufs:
            b.zero_()

    # ---- untimed: baseline files and the tenantkv store -------------------------------------
    print(f"[{shape.tokens} tokens] storing (untimed): raw, aes-gcm, tenantkv ...", flush=True)
    base_dir = workdir / "baselines"
    base_dir.mkdir()
    dir_fd = os.open(base_dir, os.O_RDONLY)
    pool = LayerWorkers(threads, shape)
    cipher = SegmentCipher(shape)
    raw_fd = aes_fd = -1
    kv = None
    try:
        raw_file, aes_file = base_dir / "raw.bin", base_dir / "aes.bin"
        raw_store(raw_file, [memoryview(b) for b in plain], dir_fd)
        plain_segments = [split(memoryview(b), shape.pt_spans) for b in plain]
        aes_store(aes_file, plain_segments, cipher, pool, shape, dir_fd)
        del plain_segments
        if aes_file.stat().st_size != shape.total_ct_bytes:
            raise AssertionError(f"{aes_file}: size != {shape.total_ct_bytes}")
        raw_fd, aes_fd = os.open(raw_file, os.O_RDONLY), os.open(aes_file, os.O_RDONLY)

        root = workdir / "tenantkv"
        kv = tenantkv.open(root)
        layout = deepseek_layout(shape.layers)
        ns = tenant_namespace(kv, "bench", layout, quota_bytes=64 * 2**30)  # every rep's prefix
        stored = ns.store(tokens, want)
        n = ns.lookup(tokens)
        if stored != shape.tokens or n != shape.tokens:
            raise RuntimeError(f"ns.store stored {stored}, ns.lookup found {n} of {shape.tokens}")
        hit = tokens[:n]

        # ---- untimed: warm-up + correctness of every method ---------------------------------
        print(f"[{shape.tokens} tokens] checking every method's bytes (untimed) ...", flush=True)
        zero_bufs()
        raw_load(raw_fd, dst_views, shape)
        verify_buffers("raw load", bufs, want)
        zero_bufs()
        aes_load(aes_fd, dst_segments, cipher, pool, shape)
        verify_buffers("aes-gcm load", bufs, want)
        check_load(ns, hit, want, device="cpu")
        skipped: dict[str, str] = {}
        zero_bufs()
        try:
            check_load(ns, hit, want, out=bufs, device="cpu")
        except Exception as err:  # the library's out= is new: report, do not crash the run
            skipped["out"] = f"out= mode failed its check: {type(err).__name__}: {err}"
        if "out" in skipped:
            print(f"[{shape.tokens} tokens] SKIPPING out= mode: {skipped['out']}", flush=True)

        # ---- timed: round-robin, one rep of each method per round ---------------------------
        print(f"[{shape.tokens} tokens] timing {reps} rounds ...", flush=True)
        first_layer: dict[str, list[float]] = {m: [] for m in MODES}

        def tkv_measure(mode: str) -> Callable[[int], float]:
            out = {"out": bufs} if mode == "out" else {}

            def measure(_: int) -> float:
                times = timed_load(ns, hit, device="cpu", **out)
                if times.layers != shape.layers:
                    raise AssertionError(f"{mode}: {times.layers} layers, expected {shape.layers}")
                first_layer[mode].append(times.first)
                return times.last

            return measure

        methods: dict[str, Callable[[int], float]] = {
            "raw": stopwatch(lambda _: raw_load(raw_fd, dst_views, shape)),
            "aes": stopwatch(lambda _: aes_load(aes_fd, dst_segments, cipher, pool, shape)),
        }
        for mode in MODES:
            if mode not in skipped:
                methods[mode] = tkv_measure(mode)
        seconds = round_robin(methods, reps)

        nbytes = shape.total_bytes
        size = SizeResult(
            shape,
            raw=Result("raw load: preadv", "raw", 1, nbytes, seconds["raw"]),
            aes=Result(
                "aes-gcm load: preadv+decrypt_into", "aes-gcm", threads, nbytes, seconds["aes"]
            ),
            skipped=skipped,
        )
        for mode in MODES:
            if mode in seconds:
                size.modes[mode] = ModeResult(
                    Result(MODE_LABEL[mode], "tenantkv", None, nbytes, seconds[mode]),
                    first_layer[mode],
                    layers=shape.layers,
                )
    finally:
        for fd in (raw_fd, aes_fd):
            if fd >= 0:
                os.close(fd)
        pool.close()
        os.close(dir_fd)
        if kv is not None:
            kv.close()
    shutil.rmtree(base_dir, ignore_errors=True)  # the tenantkv cache stays for the RSS runs
    return size


# --------------------------------------------------------------------------- #
# Reporting
# --------------------------------------------------------------------------- #


def rss_bound(shape: Shape, ring: int) -> int:
    return ring + IN_FLIGHT_LAYERS * shape.layer_bytes + RSS_SLACK_BYTES


def size_label(shape: Shape) -> str:
    return tokens_label(shape.tokens)


def print_report(
    sizes: Sequence[SizeResult], reps: int, threads: int, ring: int, rss_interval_ms: float
) -> dict[str, Any]:
    """Print every table; return the ratios and verdicts for the JSON."""
    summary: dict[str, Any] = {}

    # ---- throughput --------------------------------------------------------------------------
    rows: list[tuple[str, Sequence[float], str]] = []
    for s in sizes:
        lab = size_label(s.shape)
        rows.append((f"{lab} {s.raw.name} (1 thr)", s.raw.gbps, f"{s.raw.median_ms:.1f}"))
        rows.append((f"{lab} {s.aes.name} ({threads} thr)", s.aes.gbps, f"{s.aes.median_ms:.1f}"))
        for mode in MODES:
            if mode in s.modes:
                r = s.modes[mode].load
                rows.append((f"{lab} {r.name}", r.gbps, f"{r.median_ms:.1f}"))
            else:
                rows.append((f"{lab} {MODE_LABEL[mode]}", [float("nan")], "SKIPPED"))
    print(f"Load throughput ({reps} rounds; GB/s of plaintext, 1 GB = 1e9 B)")
    print(format_stats_table(rows, "GB/s", label="method", digits=3, note_header="median ms"))

    # ---- ratios ------------------------------------------------------------------------------
    print()
    print("Ratios of medians (same run)")
    ratio_rows: list[tuple[str, float, str]] = []
    for s in sizes:
        lab = size_label(s.shape)
        for mode in MODES:
            if mode not in s.modes:
                ratio_rows.append((f"{lab} {mode}: skipped", float("nan"), s.skipped.get(mode, "")))
                continue
            med = s.modes[mode].load.median_gbps
            ratio = med / s.aes.median_gbps
            verdict = "meets" if ratio >= THROUGHPUT_TARGET else "BELOW"
            ratio_rows.append(
                (
                    f"{lab} tenantkv {mode} / aes-gcm limit ({threads} thr)",
                    ratio,
                    f"{verdict} target >= {THROUGHPUT_TARGET}",
                )
            )
            ratio_rows.append((f"{lab} tenantkv {mode} / raw load", med / s.raw.median_gbps, ""))
        ratio_rows.append(
            (
                f"{lab} aes-gcm limit / raw load",
                s.aes.median_gbps / s.raw.median_gbps,
                "cost of crypto",
            )
        )
    print(format_ratios(ratio_rows))
    summary["ratios"] = {name: value for name, value, _ in ratio_rows if value == value}

    # ---- time to first layer -----------------------------------------------------------------
    print()
    print(
        f"Time to first layer (TTFL) and total load time ({reps} reps); "
        f"targets: TTFL/(total/L) <= {TTFL_RATIO_TARGET:g}, TTFL <= {TTFL_ABS_TARGET_MS:g} ms"
    )
    rows = []
    verdicts: dict[str, str] = {}
    for s in sizes:
        lab = size_label(s.shape)
        for mode in MODES:
            if mode not in s.modes:
                continue
            m = s.modes[mode]
            ttfl_ms = [x * 1e3 for x in m.first_layer]
            ratio = m.ttfl_ratio
            med_ttfl, med_ratio = statistics.median(ttfl_ms), statistics.median(ratio)
            ok_abs = "meets" if med_ttfl <= TTFL_ABS_TARGET_MS else "ABOVE"
            ok_ratio = "meets" if med_ratio <= TTFL_RATIO_TARGET else "ABOVE"
            verdicts[f"{lab} {mode} ttfl"] = ok_abs
            verdicts[f"{lab} {mode} ttfl_ratio"] = ok_ratio
            rows.append(
                (f"{lab} {mode}: TTFL ms", ttfl_ms, f"{ok_abs} <= {TTFL_ABS_TARGET_MS:g} ms")
            )
            rows.append((f"{lab} {mode}: total ms", [x * 1e3 for x in m.load.seconds], ""))
            rows.append(
                (
                    f"{lab} {mode}: TTFL / (total/{s.shape.layers})",
                    ratio,
                    f"{ok_ratio} <= {TTFL_RATIO_TARGET:g}",
                )
            )
    if rows:
        print(
            format_stats_table(rows, "", label="metric", digits=2, note_header="verdict (median)")
        )
    else:
        print("  (no tenantkv mode was measured)")
    summary["ttfl_verdicts"] = verdicts

    # ---- RSS -----------------------------------------------------------------------------------
    if any(s.rss for s in sizes):
        print()
        print(
            "Peak RSS growth of one load (fresh subprocess, RSS sampled every "
            f"{rss_interval_ms:g} ms); bound = staging ring {ring / MiB:.0f} MiB + "
            f"{IN_FLIGHT_LAYERS} layers in flight + {RSS_SLACK_BYTES // MiB} MiB slack"
        )
        hdr = (
            f"{'size':<5}  {'mode':<5}  {'prefix MiB':>10}  {'layer MiB':>9}  "
            f"{'peak growth MiB':>15}  {'VmHWM growth MiB':>16}  {'after MiB':>9}  "
            f"{'samples':>7}  {'bound MiB':>9}  verdict"
        )
        print(hdr)
        print("-" * len(hdr))
        rss_verdicts: dict[str, str] = {}
        for s in sizes:
            for mode in MODES:
                r = s.rss.get(mode)
                if r is None:
                    continue
                lab = size_label(s.shape)
                pre = (
                    f"{lab:<5}  {mode:<5}  {s.shape.total_bytes / MiB:>10.1f}  "
                    f"{s.shape.layer_bytes / MiB:>9.1f}"
                )
                if "error" in r:
                    print(f"{pre}  SKIPPED: {r['error']}")
                    continue
                bound = rss_bound(s.shape, ring)
                verdict = "within" if r["growth"] <= bound else "ABOVE"
                rss_verdicts[f"{lab} {mode}"] = verdict
                hwm = "-" if r.get("hwm_growth") is None else f"{r['hwm_growth'] / MiB:.1f}"
                print(
                    f"{pre}  {r['growth'] / MiB:>15.1f}  {hwm:>16}  {r['after'] / MiB:>9.1f}  "
                    f"{r['samples']:>7}  {bound / MiB:>9.1f}  {verdict}"
                )
        # flatness: growth between the smallest and largest size, per GB of prefix
        if len(sizes) > 1:
            small, large = sizes[0], sizes[-1]
            for mode in MODES:
                a, b = small.rss.get(mode, {}), large.rss.get(mode, {})
                if "growth" not in a or "growth" not in b:
                    continue
                d_prefix = (large.shape.total_bytes - small.shape.total_bytes) / GB
                d_growth = (b["growth"] - a["growth"]) / MiB
                d_layers = (
                    IN_FLIGHT_LAYERS * (large.shape.layer_bytes - small.shape.layer_bytes) / MiB
                )
                flat = (
                    "flat" if d_growth <= d_layers + RSS_SLACK_BYTES / MiB else "GROWS with prefix"
                )
                rss_verdicts[f"{mode} flatness"] = flat
                print(
                    f"  {mode}: {size_label(small.shape)} -> {size_label(large.shape)}: growth "
                    f"{d_growth:+.1f} MiB for {d_prefix:+.2f} GB more prefix "
                    f"({d_growth / d_prefix:.1f} MiB per GB; {IN_FLIGHT_LAYERS} larger in-flight "
                    f"layers alone would be {d_layers:+.1f} MiB): {flat}"
                )
        for mode in MODES:
            per_size = [v for k, v in rss_verdicts.items() if k.endswith(f" {mode}")]
            if not per_size:
                continue
            flat = rss_verdicts.get(f"{mode} flatness", "flat")
            ok = flat == "flat" and all(v == "within" for v in per_size)
            overall = "MEETS" if ok else "MISSES"
            rss_verdicts[f"{mode} overall"] = overall
            why = f"{flat}; within the bound at {per_size.count('within')}/{len(per_size)} sizes"
            print(
                f"  {mode}: RSS target (flat and within the bound at every size): {overall} ({why})"
            )
        summary["rss_verdicts"] = rss_verdicts
    return summary


# --------------------------------------------------------------------------- #
# Plot
# --------------------------------------------------------------------------- #

_COLOURS = {"raw": "#8c8c8c", "aes": "#1f77b4", "fresh": "#ff7f0e", "out": "#2ca02c"}


def plot(sizes: Sequence[SizeResult], path: Path, title: str, threads: int, ring: int) -> None:
    plt = pyplot()
    labels = [f"{s.shape.tokens:,} tok\n{s.shape.total_bytes / MB:.0f} MB" for s in sizes]
    x = list(range(len(sizes)))
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.8))

    def finish(ax: Any, headroom: float, ylabel: str, panel: str, legend_at: str) -> None:
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylim(0, headroom * ax.get_ylim()[1])  # room for the labels and the legend
        ax.set_ylabel(ylabel)
        ax.set_title(panel, fontsize=10)
        ax.legend(fontsize=7, loc=legend_at)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)

    # (a) throughput
    ax = axes[0]
    series = [
        ("raw", "raw preadv (1 thr)", [s.raw.gbps for s in sizes]),
        ("aes", f"aes-gcm limit ({threads} thr)", [s.aes.gbps for s in sizes]),
        (
            "fresh",
            "tenantkv fresh",
            [s.modes["fresh"].load.gbps if "fresh" in s.modes else None for s in sizes],
        ),
        (
            "out",
            "tenantkv out=",
            [s.modes["out"].load.gbps if "out" in s.modes else None for s in sizes],
        ),
    ]
    width = 0.8 / len(series)
    for k, (key, name, vals) in enumerate(series):
        med, err = whiskers(vals)
        pos = [i + (k - (len(series) - 1) / 2) * width for i in x]
        bars = ax.bar(
            pos, med, width, yerr=err, capsize=3, color=_COLOURS[key], edgecolor="black", label=name
        )
        for bar, v, hi, present in zip(bars, med, err[1], vals, strict=True):
            text = f"{v:.2f}" if present else "skip"
            ax.annotate(  # the median, written just above the max whisker
                text,
                (bar.get_x() + bar.get_width() / 2, v + hi),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                fontsize=7,
            )
    finish(
        ax, 1.2, "GB/s (plaintext); median, whiskers = min/max", "load throughput", "upper right"
    )

    # (b) time to first layer
    ax = axes[1]
    width = 0.35
    for k, mode in enumerate(MODES):
        vals = [
            [v * 1e3 for v in s.modes[mode].first_layer] if mode in s.modes else None for s in sizes
        ]
        med, err = whiskers(vals)
        pos = [i + (k - 0.5) * width for i in x]
        ax.bar(
            pos,
            med,
            width,
            yerr=err,
            capsize=3,
            color=_COLOURS[mode],
            edgecolor="black",
            label=f"TTFL tenantkv {mode}",
        )
        limit = [
            TTFL_RATIO_TARGET * statistics.median(s.modes[mode].load.seconds) / s.shape.layers * 1e3
            if mode in s.modes
            else float("nan")
            for s in sizes
        ]
        ax.scatter(
            pos,
            limit,
            marker="_",
            s=400,
            color="red",
            zorder=3,
            label="3/L x median total" if k == 0 else None,
        )
    ax.axhline(
        TTFL_ABS_TARGET_MS,
        color="red",
        linestyle="--",
        linewidth=1,
        label=f"{TTFL_ABS_TARGET_MS:g} ms target",
    )
    ylabel = "ms from ns.load() to layer 0; median, whiskers = min/max"
    finish(ax, 1.2, ylabel, "time to first layer", "upper left")

    # (c) RSS growth
    ax = axes[2]
    for k, mode in enumerate(MODES):
        vals = [s.rss.get(mode, {}).get("growth") for s in sizes]
        pos = [i + (k - 0.5) * width for i in x]
        heights = [v / MiB if v is not None else 0.0 for v in vals]
        bars = ax.bar(
            pos, heights, width, color=_COLOURS[mode], edgecolor="black", label=f"tenantkv {mode}"
        )
        for bar, v in zip(bars, vals, strict=True):
            text = f"{v / MiB:.0f}" if v is not None else "skip"
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                fontsize=7,
            )
    ax.axhline(
        ring / MiB,
        color="black",
        linestyle=":",
        linewidth=1,
        label=f"staging ring {ring / MiB:.0f} MiB",
    )
    ax.scatter(
        x,
        [rss_bound(s.shape, ring) / MiB for s in sizes],
        marker="_",
        s=900,
        color="red",
        zorder=3,
        label=f"bound: ring + {IN_FLIGHT_LAYERS} layers + {RSS_SLACK_BYTES // MiB} MiB",
    )
    title_c = "peak RSS growth vs prefix size (fresh subprocess)"
    finish(ax, 1.3, "peak RSS growth during one load (MiB)", title_c, "upper left")

    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__, reps=5, layers=61, threads=True, seed=0)
    p.add_argument(
        "--tokens",
        type=block_sizes,
        default="8192,32768",
        help="comma-separated prefix sizes (default 8192,32768)",
    )
    p.add_argument(
        "--rss-interval-ms", type=float, default=1.0, help="RSS sampling period (default 1)"
    )
    p.add_argument("--skip-rss", action="store_true", help="skip the peak-RSS subprocesses")
    args = p.parse_args(argv)
    args.token_sizes = sorted(set(args.tokens))
    for name in ("layers", "reps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.rss_interval_ms <= 0:
        p.error("--rss-interval-ms must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--rss-child"]:
        print(json.dumps(rss_child(json.loads(argv[1]))), flush=True)
        return 0
    args = parse_args(argv)
    tenantkv = import_tenantkv()
    ring, ring_source = ring_bytes(tenantkv)
    shapes = [Shape(layers=args.layers, tokens=t) for t in args.token_sizes]
    parent = args.dir

    largest = shapes[-1]
    need_disk = 3 * largest.total_ct_bytes + 256 * MiB
    free_disk = shutil.disk_usage(parent).free
    if need_disk > free_disk:
        sys.exit(
            f"error: need ~{need_disk / GB:.1f} GB free in {parent}, have {free_disk / GB:.1f} GB"
        )

    machine = print_machine(parent)
    releases_gil = aesgcm_releases_gil()
    seg = f"{BLOCK_TOKENS * largest.token_bytes:,} B plaintext + {TAG_BYTES} B tag"
    print_kv(
        "Data",
        {
            "prefix": f"{args.layers} layers x {VALUES_PER_TOKEN} bf16 "
            f"({largest.token_bytes} B per token per layer)",
            "sizes": ", ".join(
                f"{s.tokens:,} tokens = {s.total_bytes / MB:.1f} MB "
                f"({s.layer_bytes / MiB:.1f} MiB/layer)"
                for s in shapes
            ),
            "segment": f"{BLOCK_TOKENS} tokens x 1 layer = {seg} (aes-gcm limit)",
            "repetitions": f"{args.reps} round-robin rounds after one untimed check per method",
            "aes threads": str(args.threads),
            "aes-gcm GIL": "released during decrypt_into"
            if releases_gil
            else "HELD during decrypt_into",
            "staging ring": f"{ring / MiB:.0f} MiB ({ring_source})",
        },
    )
    try:
        import psutil  # type: ignore[import-untyped]

        need_mem = 5.2 * largest.total_bytes
        avail = psutil.virtual_memory().available
        if need_mem > avail:
            print(
                f"warning: the largest size wants ~{need_mem / GB:.1f} GB of memory (data, "
                f"buffers, page cache of 3 files); {avail / GB:.1f} GB available: loads may "
                "hit the disk\n"
            )
    except ImportError:
        if not args.skip_rss:
            sys.exit("error: psutil is needed for the RSS measurement (or pass --skip-rss)")

    t0 = time.perf_counter()
    sizes: list[SizeResult] = []
    for shape in shapes:
        workdir = Path(tempfile.mkdtemp(prefix=f"tenantkv-stream-{shape.tokens}-", dir=parent))
        try:
            sizes.append(
                bench_size(
                    tenantkv,
                    shape,
                    workdir,
                    args.reps,
                    args.threads,
                    args.seed,
                    args.rss_interval_ms / 1e3,
                    args.skip_rss,
                )
            )
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        gc.collect()
    print(f"measured in {time.perf_counter() - t0:.0f} s\n")

    summary = print_report(sizes, args.reps, args.threads, ring, args.rss_interval_ms)

    title = (
        f"tenantkv layer-wise streaming load: {args.layers} layers x 576 bf16, {args.reps} reps; "
        f"{machine['cpu']}, {machine['cores']} cores, python {machine['python']}, "
        f"cryptography {machine['cryptography'].split()[0]}"
    )
    report = {
        "machine": machine,
        "reps": args.reps,
        "threads": args.threads,
        "aesgcm_releases_gil": releases_gil,
        "staging_ring_bytes": ring,
        "sizes": [
            {
                "tokens": s.shape.tokens,
                "layers": s.shape.layers,
                "bytes": s.shape.total_bytes,
                "raw_load": s.raw.as_dict(),
                "aes_load": s.aes.as_dict(),
                "tenantkv": {
                    mode: m.load.as_dict()
                    | {"first_layer_seconds": m.first_layer, "ttfl_ratio": m.ttfl_ratio}
                    for mode, m in s.modes.items()
                },
                "skipped": s.skipped,
                "rss": s.rss,
            }
            for s in sizes
        ],
        "summary": summary,
    }
    write_outputs(
        args.out, "streaming", report, lambda png: plot(sizes, png, title, args.threads, ring)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
