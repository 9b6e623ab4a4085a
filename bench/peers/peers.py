#!/usr/bin/env python3
"""tenantkv's encrypted load against unencrypted peers, on this machine, in one run.

Run in bench/peers/.venv (``bash bench/peers/setup.sh`` builds it)::

    bench/peers/.venv/bin/python bench/peers/peers.py            # 8K and 32K tokens, 5 rounds
    bench/peers/.venv/bin/python bench/peers/peers.py --smoke    # seconds: tiny sizes, 1 round

For each prefix size (a DeepSeek-V3-shaped prefix: 61 layers x T tokens x 576 bf16 = 1,152 B
per token per layer), every system of ``systems.py`` and ``lmcache_peer.py`` loads it from a warm
page cache into CPU memory. One untimed warm-up load of each system is checked byte for byte
against the original; then ``--reps`` rounds, each timing one load of every system (the order
alternates: forward, then backward, so drifting machine load hits all alike and every system
sits in the middle on average; a backward round starts with the files the forward round used
last, which the page cache still holds when memory is short), and after each timed load,
untimed, every loaded byte is compared with the original. Where every system's files exceed
``--page-cache-share`` of the memory available (32K tokens on a 24 GiB machine), the systems are
warmed and timed in groups, one after another, LMCache in each (:func:`split_for_page_cache`).

Then: a 128K-token lookup (2,048 blocks, all hits) in tenantkv against a vLLM-style sha256 chain
and LMCache's token database; and 16 tenants of one TenantKV loading at once for a fixed window.

Writes BENCHMARKS.md (repository root by default; ``--benchmarks``), PNG plots and
``peers.json`` under ``--out`` (default bench/peers/results). ``--smoke`` writes them to a
temporary directory instead, never over the committed ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

PEERS_DIR = Path(__file__).resolve().parent
REPO_ROOT = PEERS_DIR.parent.parent
for p in (str(PEERS_DIR), str(PEERS_DIR.parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

import modes as M  # noqa: E402
import report  # noqa: E402
import systems as S  # noqa: E402
from _common import GB, machine_info  # noqa: E402
from _fixtures import (  # noqa: E402
    VALUES_PER_TOKEN,
    deepseek_layout,
    prefix_tokens,
    random_layers,
    same_bits,
    tenant_namespace,
    vllm_style_chain,
)
from store_load import SegmentCipher, Shape  # noqa: E402

LAYERS = 61
DEFAULT_TOKENS = (8192, 32768)
LOOKUP_TOKENS = 131_072  # 2,048 blocks of 64
TENANTS = 16
#: The decrypt-only ceiling holds the prefix's ciphertext in memory: measured up to 1 GiB (8K
#: tokens), where it does not crowd the page cache the other systems load from.
CEILING_MAX_BYTES = 2**30

#: The share of available memory that every system's files may take and still be timed side by
#: side; beyond it the systems run in groups (the rest of memory holds the prefix, the
#: destinations, LMCache's pool and what the systems allocate while they load).
PAGE_CACHE_SHARE = 0.5


# --------------------------------------------------------------------------- #
# One prefix size
# --------------------------------------------------------------------------- #


@dataclass
class SizeRun:
    shape: Shape
    systems: list[S.System]
    order: list[list[str]] = field(default_factory=list)  # per round, the order systems ran
    mem_available_gib: float = 0.0
    # The systems timed together, when their files did not fit the page cache at once (groups,
    # each warm in turn); one list of every system otherwise.
    groups: list[list[str]] = field(default_factory=list)
    page_cache_share: float = PAGE_CACHE_SHARE  # the threshold of that split


def key(system: S.System) -> str:
    return f"{system.name} [{system.note}]" if system.note else system.name


def verify(system: S.System, loaded: Any, want: Sequence[torch.Tensor], chunked: bool) -> None:
    """Every byte of what ``system`` loaded equals the original (raises AssertionError)."""
    got = system.layers(loaded)
    if len(got) != len(want):
        raise AssertionError(f"{key(system)}: {len(got)} layers, expected {len(want)}")
    for layer, (parts, original) in enumerate(zip(got, want, strict=True)):
        row = 0
        for part in parts:
            rows = part.shape[0]
            if not same_bits(part, original[row : row + rows]):
                raise AssertionError(f"{key(system)}: layer {layer} rows {row}.. differ")
            row += rows
        if row != original.shape[0] or (not chunked and len(parts) != 1):
            raise AssertionError(f"{key(system)}: layer {layer} has {row} rows")


def mem_available_gib() -> float:
    try:
        import psutil  # type: ignore[import-untyped]

        return float(psutil.virtual_memory().available) / 2**30
    except Exception:
        return float("nan")


def run_size(
    tenantkv: Any,
    tokens: int,
    reps: int,
    threads: int,
    workdir: Path,
    seed: int,
    page_cache_share: float = PAGE_CACHE_SHARE,
) -> SizeRun:
    """Write every system's files (untimed), check each once, then time ``reps`` rounds (in
    groups when the files exceed ``page_cache_share`` of the available memory)."""
    import lmcache_peer

    shape = Shape(layers=LAYERS, tokens=tokens)
    label = f"[{tokens} tokens]"
    print(f"{label} writing {shape.total_bytes / 1e6:.0f} MB per system (untimed) ...", flush=True)
    st_dir = workdir / "safetensors"
    want, offsets = S.write_layer_files(st_dir, shape, seed)
    fds = [os.open(S.safetensors_path(st_dir, i), os.O_RDONLY) for i in range(LAYERS)]
    cipher = SegmentCipher(shape)
    enc_path = workdir / "encrypted.bin"
    S.write_encrypted_file(enc_path, want, shape, cipher)
    enc_fd = os.open(enc_path, os.O_RDONLY)
    torch_path = workdir / "prefix.pt"
    torch.save([w.clone() for w in want], torch_path)
    token_ids = prefix_tokens(seed, tokens)

    lmc = lmcache_peer.LMCachePeer(workdir / "lmcache", LAYERS, tokens, VALUES_PER_TOKEN, S.DTYPE)
    lmc.store(torch.tensor(token_ids, dtype=torch.long), want)
    suites = S.suite_names(tenantkv)
    caches = [
        S.TenantkvPrefix(tenantkv, workdir / f"tenantkv-{suite}", suite, shape, token_ids, want)
        for suite in suites
    ]
    # The default suite once more at LMCache's granularity: blocks of its chunk size, so a
    # segment (one block of one layer) is 4x as large, and a load decrypts it in one call.
    chunk = lmcache_peer.CHUNK_TOKENS
    caches.append(
        S.TenantkvPrefix(
            tenantkv,
            workdir / f"tenantkv-{suites[0]}-{chunk}",
            suites[0],
            shape,
            token_ids,
            want,
            block_tokens=chunk,
        )
    )

    bufs = [torch.empty(tokens, VALUES_PER_TOKEN, dtype=S.DTYPE).zero_() for _ in range(LAYERS)]

    def zero() -> None:
        # One thread (numpy), not torch's zero_(): that runs on torch's OpenMP pool, whose
        # threads then spin for a while on a machine's few cores. Zeroing then loading back
        # to back (tenantkv out=, 8K, 40 alternating loads), the first layer took 6.72 ms at
        # the median after zero_(), 4.28 after this fill and 5.02 with no zeroing.
        for b in bufs:
            b.view(torch.uint8).numpy().fill(0)

    pool = S.LayerWorkers(threads, shape)
    # The ceiling on one thread too: how far decryption scales with threads in one process.
    solo = S.LayerWorkers(1, shape) if threads > 1 else None
    lmc_system = S.System(
        "LMCache LocalDiskBackend",
        "lmcache",
        lambda: _timed_total(lmc.load),
        lambda objs: [lmc.layer_views(objs, layer) for layer in range(LAYERS)],
        release=lmc.release,
        ttfl_is_total=True,
        note=f"{lmcache_peer.CHUNK_TOKENS}-token chunks, dst cpu",
    )
    systems: list[S.System] = [
        *S.raw_systems(fds, offsets, bufs, pool, zero),
        S.encrypted_limit_system(enc_fd, bufs, shape, cipher, pool, zero),
        # held in memory: only where the prefix's ciphertext is small beside the page cache
        *(
            S.decrypt_ceiling_systems(
                enc_fd, bufs, shape, cipher, [p for p in (pool, solo) if p is not None], zero
            )
            if shape.total_ct_bytes <= CEILING_MAX_BYTES
            else []
        ),
        lmc_system,
        *S.safetensors_systems(st_dir, shape, bufs, zero),
        S.torch_save_system(torch_path),
    ]
    # What each system reads, for page-cache planning: its files (or directories of files).
    files: dict[int, list[Path]] = {}
    for system in systems:
        files[id(system)] = {
            "raw": [st_dir],
            "safetensors": [st_dir],
            "encrypted-limit": [enc_path],
            "decrypt-ceiling": [enc_path],
            "lmcache": [workdir / "lmcache"],
            "torch": [torch_path],
        }[system.group]
    for cache in caches:
        for system in cache.systems(bufs, zero):
            systems.append(system)
            files[id(system)] = [cache.root]
    run = SizeRun(
        shape, systems, mem_available_gib=mem_available_gib(), page_cache_share=page_cache_share
    )
    groups = split_for_page_cache(systems, files, run.mem_available_gib, page_cache_share)
    run.groups = [[key(s) for s in group] for group in groups]
    try:
        check_the_check(systems[0], want)
        for number, group in enumerate(groups):
            if len(groups) > 1:
                others = {p for s in systems if s not in group for p in files[id(s)]}
                evict(others - {p for s in group for p in files[id(s)]})
                print(
                    f"{label} group {number + 1} of {len(groups)}: {len(group)} systems", flush=True
                )
            print(f"{label} warm-up: one checked load of each of {len(group)} systems", flush=True)
            for system in group:
                one_load(system, want, timed=False)
            print(f"{label} timing {reps} rounds (forward, backward, ...) ...", flush=True)
            for r in range(reps):
                order = group if r % 2 == 0 else group[::-1]
                run.order.append([key(s) for s in order])
                for system in order:
                    one_load(system, want, timed=True)
    finally:
        pool.close()
        if solo is not None:
            solo.close()
        for cache in caches:
            cache.close()
        lmc.close()
        for fd in (*fds, enc_fd):
            os.close(fd)
    return run


def _files_under(path: Path) -> list[Path]:
    """``path`` itself if it is a file, else every file under the directory."""
    return [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]


def split_for_page_cache(
    systems: list[S.System],
    files: dict[int, list[Path]],
    available_gib: float,
    share: float = PAGE_CACHE_SHARE,
) -> list[list[S.System]]:
    """Every system in one group when all their files fit ``share`` of the memory available;
    else groups, each timed warm in turn: the raw reads and safetensors (their layer files)
    with the encrypted limit and ceiling; tenantkv's caches, as many together as fit beside
    LMCache's files (at least one); torch.save (whose loads allocate a whole prefix). LMCache,
    the baseline of every ratio, is timed in each."""
    budget = share * available_gib * 2**30

    def size(paths: set[Path]) -> int:
        return sum(f.stat().st_size for p in paths for f in _files_under(p))

    if size({p for s in systems for p in files[id(s)]}) <= budget:
        return [systems]
    baseline = {id(s) for s in systems if s.group == "lmcache"}
    room = budget - size({p for s in systems if id(s) in baseline for p in files[id(s)]})
    caches: dict[Path, list[S.System]] = {}  # tenantkv's systems by their cache's root
    for s in systems:
        if s.group == "tenantkv":
            caches.setdefault(files[id(s)][0], []).append(s)
    packs: list[set[int]] = []
    used = 0.0
    for root, members in caches.items():
        need = size({root})
        if packs and used + need <= room:
            packs[-1].update(id(s) for s in members)
            used += need
        else:
            packs.append({id(s) for s in members})
            used = need
    raw = {"raw", "safetensors", "encrypted-limit", "decrypt-ceiling"}
    groups = [
        [s for s in systems if s.group in raw or id(s) in baseline],
        *([s for s in systems if id(s) in baseline or id(s) in pack] for pack in packs),
        [s for s in systems if s.group == "torch" or id(s) in baseline],
    ]
    assert {id(s) for group in groups for s in group} == {id(s) for s in systems}
    return groups


def evict(paths: set[Path]) -> None:
    """Drop ``paths``' pages (files, or every file under a directory) from the page cache."""
    for file in (f for p in paths for f in _files_under(p)):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def check_the_check(system: S.System, want: Sequence[torch.Tensor]) -> None:
    """Positive control: the byte check rejects a load with one flipped bit in its last byte."""
    loaded, _first, _total = system.run()
    last = system.layers(loaded)[-1][-1].view(torch.uint8).view(-1)
    last[-1] ^= 1
    try:
        verify(system, loaded, want, chunked=False)
    except AssertionError:
        return
    finally:
        system.release(loaded)
    raise AssertionError("the byte check accepted a load with a flipped bit")


def _timed_total(load: Callable[[], Any]) -> tuple[Any, float, float]:
    t0 = time.perf_counter()
    got = load()
    t1 = time.perf_counter()
    return got, t1 - t0, t1 - t0


def one_load(system: S.System, want: Sequence[torch.Tensor], *, timed: bool) -> None:
    """Prepare, load (timed, garbage collector off), then check every byte untimed."""
    import gc

    system.prepare()
    gc.collect()
    before = storage_read_bytes()
    gc.disable()
    try:
        loaded, first, total = system.run()
    finally:
        gc.enable()
    cold = storage_read_bytes() - before
    try:
        verify(system, loaded, want, chunked=system.group == "lmcache")
    finally:
        system.release(loaded)
        del loaded
    if timed:
        system.seconds.append(total)
        system.first_layer.append(first)
        system.cold_bytes.append(cold)


def storage_read_bytes() -> int:
    """Bytes this process has had fetched from storage (``/proc/self/io`` ``read_bytes``).

    A load from a warm page cache fetches none; a positive delta around a load means some of
    its files had been evicted (memory pressure), and the table shows it.
    """
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# --------------------------------------------------------------------------- #
# Lookups of a 128K-token prompt
# --------------------------------------------------------------------------- #


def measure_lookups(tenantkv: Any, workdir: Path, tokens: int, reps: int, seed: int) -> dict:
    """Min/median/max ms of each lookup over ``reps`` calls, after one untimed call each."""
    import lmcache_peer

    print(f"[lookup] storing a {tokens}-token prompt (small layout; untimed) ...", flush=True)
    ids = prefix_tokens(seed + 7, tokens)
    # The lookup reads block keys, not KV: a 1-layer layout keeps the store small. Stored in
    # eight steps with start= (as a long conversation grows), so the index holds 8 extents.
    layout = tenantkv.KVLayout.mla(1, kv_lora_rank=32, rope_dim=32, dtype=S.DTYPE)
    results: dict[str, list[float]] = {}
    with tenantkv.open(workdir / "lookup") as kv:
        ns = tenant_namespace(kv, "peers", layout, model="lookup", quota_bytes=2**30)
        steps = 8
        step = tokens // steps
        for i in range(steps):
            end = (i + 1) * step
            layer = torch.zeros(end - i * step, 64, dtype=S.DTYPE)
            ns.store(ids[:end], [layer], start=i * step)
        found = ns.lookup(ids)
        if found != tokens:
            raise RuntimeError(f"tenantkv lookup found {found} of {tokens} tokens")
        results["tenantkv ns.lookup (SQLite)"] = _time_calls(lambda: ns.lookup(ids), reps, tokens)

    none_hash = hashlib.sha256(b"none").digest()
    blocks = tokens // 64
    results["sha256 chain, 64-token blocks (vLLM-style)"] = _time_calls(
        lambda: len(vllm_style_chain(ids, 64, none_hash, protocol=5)) * 64, reps, blocks * 64
    )

    chunks = tokens // lmcache_peer.CHUNK_TOKENS
    lmc = lmcache_peer.LMCachePeer(workdir / "lookup-lmcache", 1, tokens, 64, S.DTYPE)
    try:
        as_tensor = torch.tensor(ids, dtype=torch.long)
        lmc.store(as_tensor, [torch.zeros(tokens, 64, dtype=S.DTYPE)])
        results["LMCache ChunkedTokenDatabase.process_tokens"] = _time_calls(
            lambda: len(lmc.chunk_keys(torch.tensor(ids, dtype=torch.long))) * 256,
            reps,
            chunks * 256,
        )
        results["LMCache process_tokens + LocalDiskBackend.contains"] = _time_calls(
            lambda: lmc.contains_prefix(lmc.chunk_keys(torch.tensor(ids, dtype=torch.long))) * 256,
            reps,
            chunks * 256,
        )
    finally:
        lmc.close()
    return {name: [s * 1e3 for s in seconds] for name, seconds in results.items()}


def _time_calls(fn: Callable[[], int], reps: int, expect: int) -> list[float]:
    got = fn()  # untimed first call (and the check of its answer)
    if got != expect:
        raise AssertionError(f"lookup answered {got}, expected {expect}")
    seconds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        got = fn()
        seconds.append(time.perf_counter() - t0)
        if got != expect:
            raise AssertionError(f"lookup answered {got}, expected {expect}")
    return seconds


# --------------------------------------------------------------------------- #
# 16 tenants loading at once
# --------------------------------------------------------------------------- #


def measure_tenants(
    tenantkv: Any, workdir: Path, tokens: int, window: float, reps: int, seed: int
) -> dict:
    """16 tenants in one TenantKV; each thread loads its own prefix back to back for ``window``
    seconds, ``reps`` times.

    Checks: each tenant's first load (untimed) byte for byte; during the window, before each
    load the first and last row of every layer are poisoned and after it compared with the
    original (a cheap check of every load, outside its latency); after each window, every
    tenant's buffers are compared in full with its original.
    """
    shape = Shape(layers=LAYERS, tokens=tokens)
    print(f"[tenants] storing {TENANTS} prefixes of {tokens} tokens (untimed) ...", flush=True)
    gen = torch.Generator().manual_seed(seed + 11)
    out: dict[str, Any] = {"tokens": tokens, "window_s": window, "reps": []}
    with tenantkv.open(workdir / "tenants") as kv:
        work = []
        for t in range(TENANTS):
            name = f"tenant{t:02d}"
            quota = 2 * shape.total_ct_bytes + 2**28
            ns = tenant_namespace(kv, name, deepseek_layout(LAYERS), quota_bytes=quota)
            ids = prefix_tokens(seed + 100 + t, tokens)
            want = random_layers(deepseek_layout(LAYERS), tokens, gen)
            if ns.store(ids, want) != tokens:
                raise RuntimeError(f"{name}: store did not store the prefix")
            work.append((ns, ids, want, [torch.zeros_like(w) for w in want]))
        # Every first load after every store: a prefix loaded right after its own store is read
        # from the ring of recent writes, and the next store would take its place there before
        # it ever reached the page cache (the windows would then read the disk: not warm).
        for t, (ns, ids, want, bufs) in enumerate(work):
            with ns.load(ids, out=bufs) as stream:
                for _ in stream:
                    pass
            for b, w in zip(bufs, want, strict=True):
                if not same_bits(b, w):
                    raise AssertionError(f"tenant{t:02d}: first load differs from the original")

        for rep in range(reps):
            latencies, loaded_bytes, elapsed = run_window(work, shape.total_bytes, window)
            for t, (_ns, _ids, want, bufs) in enumerate(work):
                for b, w in zip(bufs, want, strict=True):
                    if not same_bits(b, w):
                        raise AssertionError(f"tenant {t}: buffers differ after the window")
            total = sum(loaded_bytes)
            every = sorted(x for lat in latencies for x in lat)
            shares = [b / total for b in loaded_bytes]
            out["reps"].append(
                {
                    "elapsed_s": elapsed,
                    "aggregate_gbps": total / elapsed / GB,
                    "loads": len(every),
                    "loads_per_tenant": [len(lat) for lat in latencies],
                    "latencies_s": [list(lat) for lat in latencies],
                    "p50_ms": percentile(every, 0.50) * 1e3,
                    "p99_ms": percentile(every, 0.99) * 1e3,
                    "min_share": min(shares),
                    "shares": shares,
                }
            )
            r = out["reps"][-1]
            print(
                f"[tenants] rep {rep + 1}/{reps}: {r['aggregate_gbps']:.2f} GB/s, "
                f"{r['loads']} loads, p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms, "
                f"slowest share {r['min_share'] * TENANTS:.2f}x fair",
                flush=True,
            )
    return out


def run_window(
    work: Sequence[tuple[Any, list[int], list[torch.Tensor], list[torch.Tensor]]],
    nbytes: int,
    window: float,
) -> tuple[list[list[float]], list[int], float]:
    """Every tenant's thread loads back to back until ``window`` seconds have passed.

    Returns per-tenant load latencies (every load, including those that end after the window),
    per-tenant bytes received within the window (counted per layer, so a share is not rounded
    to whole loads), and the window's length as measured.
    """
    n = len(work)
    layer_bytes = nbytes // LAYERS
    latencies: list[list[float]] = [[] for _ in range(n)]
    loaded_bytes = [0] * n
    barrier = threading.Barrier(n + 1)
    stop_at = [0.0]
    errors: list[BaseException] = []

    def tenant(t: int) -> None:
        ns, ids, want, bufs = work[t]
        try:
            barrier.wait()
            while time.perf_counter() < stop_at[0]:
                for b in bufs:
                    b[0].fill_(0)
                    b[-1].fill_(0)
                t0 = time.perf_counter()
                with ns.load(ids, out=bufs) as stream:
                    for _ in stream:  # a layer counts for the share if it came in the window
                        if time.perf_counter() <= stop_at[0]:
                            loaded_bytes[t] += layer_bytes
                latencies[t].append(time.perf_counter() - t0)
                for b, w in zip(bufs, want, strict=True):
                    if not (same_bits(b[0], w[0]) and same_bits(b[-1], w[-1])):
                        raise AssertionError(f"tenant {t}: a load returned wrong bytes")
        except BaseException as err:  # re-raised by the main thread
            errors.append(err)

    threads = [threading.Thread(target=tenant, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    stop_at[0] = time.perf_counter() + window + 0.001  # set before the barrier opens
    t_start = time.perf_counter()
    barrier.wait()
    for th in threads:
        th.join()
    elapsed = stop_at[0] - t_start
    if errors:
        raise errors[0]
    return latencies, loaded_bytes, elapsed


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), int(-(-q * len(sorted_values) // 1))))
    return sorted_values[rank - 1]


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


def versions() -> dict[str, str]:
    from importlib import metadata

    def v(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {name: v(name) for name in ("lmcache", "safetensors", "numpy", "tenantkv")}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--lookup-tokens", type=int, default=LOOKUP_TOKENS)
    ap.add_argument("--lookup-reps", type=int, default=20)
    ap.add_argument("--tenant-tokens", type=int, default=2048)
    ap.add_argument("--tenant-window", type=float, default=10.0, help="seconds per rep")
    ap.add_argument("--tenant-reps", type=int, default=3)
    ap.add_argument(
        "--modes",
        default=",".join(M.MODES),
        help="the modes timed side by side at --mode-tokens (warm, cold, stored; '' for none)",
    )
    ap.add_argument("--mode-tokens", default="8192", help="the sizes the modes run at")
    ap.add_argument("--mode-reps", type=int, default=None, help="rounds of the modes (--reps)")
    ap.add_argument(
        "--modes-from",
        metavar="MODES_JSON",
        help="only write modes.md and modes.png again (into --out) from a run's modes.json",
    )
    ap.add_argument(
        "--only-modes",
        action="store_true",
        help="run the modes alone and write modes.md, modes.png and modes.json into --out "
        "(BENCHMARKS.md untouched): a machine too small or too busy for the whole run",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="where the data goes (default: system temp)")
    ap.add_argument("--out", default=None, help="plots and JSON (default bench/peers/results)")
    ap.add_argument("--benchmarks", default=None, help="default: BENCHMARKS.md at the root")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 rep: seconds")
    ap.add_argument(
        "--page-cache-share",
        type=float,
        default=PAGE_CACHE_SHARE,
        help="time the systems in groups when their files exceed this share of the "
        "available memory (0: always in groups)",
    )
    ap.add_argument(
        "--replot",
        metavar="PEERS_JSON",
        help="only redraw loads.png (into --out) from a run's peers.json, measuring nothing",
    )
    args = ap.parse_args(argv)
    args.scratch_out = None
    args.smoke_groups = False
    if args.smoke:
        # Two sizes, the second in groups: both ways of timing run on every test run.
        args.tokens, args.reps = "256,512", 1
        args.smoke_groups = True
        args.lookup_tokens, args.lookup_reps = 2048, 2
        args.tenant_tokens, args.tenant_window, args.tenant_reps = 256, 0.3, 1
        args.mode_tokens = "256"
        if args.out is None:  # never over the committed outputs; removed after the run
            args.scratch_out = tempfile.mkdtemp(prefix="peers-smoke-out-")
            args.out = args.scratch_out
        if args.benchmarks is None:
            args.benchmarks = str(Path(args.out) / "BENCHMARKS.md")
    args.out = args.out or str(PEERS_DIR / "results")
    args.benchmarks = args.benchmarks or str(REPO_ROOT / "BENCHMARKS.md")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.modes_from:
        saved = json.loads(Path(args.modes_from).read_text(encoding="utf-8"))
        runs_back = [M.from_json(r) for r in saved["runs"]]
        return write_modes_only(args, runs_back, saved["info"], saved["started"], saved=saved)
    if args.replot:
        data = json.loads(Path(args.replot).read_text(encoding="utf-8"))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        report.plot_loads(data["sizes"], Path(args.out) / "loads.png")
        print(f"redrew {Path(args.out) / 'loads.png'} from {args.replot}")
        return 0
    import tenantkv

    sizes = [int(x) for x in str(args.tokens).split(",") if x]
    for tokens in sizes:
        if tokens % 256:
            sys.exit(f"error: --tokens {tokens} is not a multiple of 256 (LMCache's chunk)")
    if args.lookup_tokens % (8 * 256):
        sys.exit("error: --lookup-tokens must be a multiple of 2,048")
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    started = time.time()
    info = machine_info(str(base))
    info["platform"] = platform.platform()
    info |= {k: v for k, v in versions().items()}
    info["suites"] = ", ".join(S.suite_names(tenantkv))
    print(json.dumps(info, indent=2), flush=True)

    runs: list[SizeRun] = []
    for number, tokens in enumerate([] if args.only_modes else sizes):
        workdir = Path(tempfile.mkdtemp(prefix=f"peers-{tokens}-", dir=base))
        share = 0.0 if args.smoke_groups and number > 0 else args.page_cache_share
        try:
            runs.append(
                run_size(tenantkv, tokens, args.reps, args.threads, workdir, args.seed, share)
            )
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            S.collect()
        report.print_size(runs[-1])

    mode_names = [m for m in str(args.modes).split(",") if m]
    unknown = set(mode_names) - set(M.MODES)
    if unknown:
        sys.exit(f"error: unknown --modes {', '.join(sorted(unknown))}")
    mode_runs: list[M.ModesRun] = []
    for tokens in [int(x) for x in str(args.mode_tokens).split(",") if x and mode_names]:
        workdir = Path(tempfile.mkdtemp(prefix=f"peers-modes-{tokens}-", dir=base))
        try:
            mode_runs.append(
                M.run_modes(
                    tenantkv,
                    LAYERS,
                    tokens,
                    args.mode_reps or args.reps,
                    args.threads,
                    workdir,
                    args.seed,
                    mode_names,
                    one_load,
                )
            )
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            S.collect()
        print(M.markdown(mode_runs[-1], report.md_table), flush=True)
    if args.only_modes:
        written = write_modes_only(args, mode_runs, info, started, argv)
        if args.scratch_out is not None:
            shutil.rmtree(args.scratch_out, ignore_errors=True)
        return written

    workdir = Path(tempfile.mkdtemp(prefix="peers-misc-", dir=base))
    try:
        lookups = measure_lookups(
            tenantkv, workdir, args.lookup_tokens, args.lookup_reps, args.seed
        )
        tenants = measure_tenants(
            tenantkv, workdir, args.tenant_tokens, args.tenant_window, args.tenant_reps, args.seed
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    cmd = "bench/peers/.venv/bin/python bench/peers/peers.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text, data = report.build(
        runs=runs,
        modes=mode_runs,
        lookups=lookups,
        tenants=tenants,
        info=info,
        args={k: v for k, v in vars(args).items() if k != "scratch_out"},
        command=cmd.strip(),
        started=started,
        plots_dir=out,
        benchmarks_path=Path(args.benchmarks),
    )
    kept = report.kept_sections(Path(args.benchmarks))  # the engines' sections, at the end
    Path(args.benchmarks).write_text(text + kept, encoding="utf-8")
    (out / "peers.json").write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    print(text)
    written = [Path(args.benchmarks), out / "peers.json"] + [
        out / f"{name}.png" for name in ("loads", "lookups", "tenants")
    ]
    missing = [str(p) for p in written if not p.is_file() or p.stat().st_size == 0]
    if missing:
        print(f"error: not written: {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"wrote {args.benchmarks}, plots and peers.json in {out}")
    if args.scratch_out is not None:
        shutil.rmtree(args.scratch_out, ignore_errors=True)
        print(f"(smoke: removed {args.scratch_out})")
    return 0


def write_modes_only(
    args: argparse.Namespace,
    mode_runs: list[M.ModesRun],
    info: dict[str, Any],
    started: float,
    argv: Sequence[str] | None = None,
    saved: dict[str, Any] | None = None,
) -> int:
    """``--only-modes``: the modes' tables with the machine, the command and the load average
    into ``modes.md`` under ``--out`` (with ``modes.png`` and ``modes.json``); ``saved``: a
    run's ``modes.json``, written again (``--modes-from``)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if saved is None:
        cmd = "bench/peers/.venv/bin/python bench/peers/peers.py " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        saved = {
            "info": info,
            "started": started,
            "command": cmd.strip(),
            "minutes": (time.time() - started) / 60,
            "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "runs": [M.as_json(r) for r in mode_runs],
        }
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    lines = [
        "# Warm, cold and just stored (`peers.py --only-modes`)",
        "",
        f"- date: {when} (the run took {saved['minutes']:.1f} min)",
        f"- command: `{saved['command']}`",
        f"- load average after the run: {saved['load_after']}"
        " (1/5/15 min; the machine is shared: other load skews every figure)",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
        *(M.markdown(run, report.md_table) for run in mode_runs),
        "",
        "![modes](modes.png)",
        "",
    ]
    if mode_runs:
        report.plot_modes(mode_runs, out / "modes.png")
    (out / "modes.md").write_text("\n".join(lines), encoding="utf-8")
    (out / "modes.json").write_text(json.dumps(saved, indent=1), encoding="utf-8")
    print(f"wrote {out / 'modes.md'}, modes.png and modes.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
