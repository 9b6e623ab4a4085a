"""The three ways a deployment meets a stored prefix, timed side by side in one run:

* **warm**: stored long ago and read since: its files are in the page cache;
* **cold**: the page cache dropped for every system's files before each load (fsync, then
  ``POSIX_FADV_DONTNEED`` per file, which disturbs other users of the machine less than
  ``drop_caches``; each load's bytes fetched from storage, ``/proc/self/io``, prove it);
* **just stored**: each round stores the prefix anew (untimed), then loads it at once, as a
  chat's next turn does.

Each mode times the same systems: the raw ``preadv`` of the same bytes (one task per layer on
one thread per core), the encrypted limit, LMCache's disk backend and tenantkv's ``out=`` load
(the default suite). Rounds alternate forward and backward through the modes and, within a
mode, through the systems. Every loaded byte is checked (``peers.one_load``).

tenantkv's warm and cold rows read a cache opened without the memory of recent writes
(``recent_writes_bytes=0``): warm is the page cache's case, cold the device's. Its just-stored
row reads a cache opened with the defaults, as a deployment's (a ring per tenant sized from
the memory available, ``tenantkv.storage.recent_owners``).

tenantkv's warm and cold modes also time its lossy codecs (``fp8``, ``int4``: each a cache and
namespace of its own holding the same prefix), decoded into the same ``out=`` buffers. Their
bytes are checked against each codec's own decode of the codes its store wrote (a lossy codec
never gives the original back); GB/s counts the decoded prefix, as for every other row, so the
rows compare tokens per second; ``from storage`` is a share of the codes the files hold. They
are not in the just-stored mode, whose rounds would time their encoding as much as the load.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import systems as S
import torch
from _common import pwrite_full
from _fixtures import VALUES_PER_TOKEN, byte_view, prefix_tokens
from store_load import SegmentCipher, Shape

MODES = ("warm", "cold", "stored")
#: The lossy codecs whose tenantkv rows the warm and cold modes add (tenantkv.codecs).
CODECS = ("fp8", "int4")
MODE_TITLES = {
    "warm": "warm (page cache)",
    "cold": "cold (page cache dropped before each load)",
    "stored": "just stored (store, then load at once)",
}


@dataclass
class ModesRun:
    shape: Shape
    modes: tuple[str, ...]
    #: mode -> the systems timed in it (their samples: seconds, first_layer, cold_bytes).
    systems: dict[str, list[Any]] = field(default_factory=dict)
    order: list[list[str]] = field(default_factory=list)


def evict_files(paths: Sequence[Path]) -> None:
    """fsync, then drop every file under ``paths`` from the page cache."""
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _with(system: S.System, mode: str, before: Callable[[], None]) -> S.System:
    """A copy of ``system`` for ``mode``: fresh samples, ``before`` ahead of its own prepare."""
    own = system.prepare

    def prepare() -> None:
        before()
        own()

    return dataclasses.replace(
        system, prepare=prepare, seconds=[], first_layer=[], cold_bytes=[], note=system.note
    )


def run_modes(
    tenantkv: Any,
    layers: int,
    tokens: int,
    reps: int,
    threads: int,
    workdir: Path,
    seed: int,
    modes: Sequence[str],
    one_load: Callable[..., None],
) -> ModesRun:
    """Write every system's files (untimed), then time ``reps`` rounds of every mode."""
    import lmcache_peer

    shape = Shape(layers=layers, tokens=tokens)
    label = f"[modes {tokens} tokens]"
    print(f"{label} writing the files of {', '.join(modes)} (untimed) ...", flush=True)
    st_dir = workdir / "safetensors"
    mapped, offsets = S.write_layer_files(st_dir, shape, seed)
    # The original in memory of its own: the files' copy-on-write views would keep their pages
    # mapped, and mapped pages stay in the page cache (the cold mode could not drop them).
    want = [m.clone() for m in mapped]
    del mapped
    S.collect()
    paths = [S.safetensors_path(st_dir, i) for i in range(shape.layers)]
    fds = [os.open(p, os.O_RDWR) for p in paths]
    cipher = SegmentCipher(shape)
    enc_path = workdir / "encrypted.bin"
    S.write_encrypted_file(enc_path, want, shape, cipher)
    enc_fd = os.open(enc_path, os.O_RDWR)
    token_ids = prefix_tokens(seed, tokens)
    bufs = [torch.empty(tokens, VALUES_PER_TOKEN, dtype=S.DTYPE).zero_() for _ in want]

    def zero() -> None:
        for b in bufs:
            b.view(torch.uint8).numpy().fill(0)

    pool = S.LayerWorkers(threads, shape)
    lmc = lmcache_peer.LMCachePeer(
        workdir / "lmcache", shape.layers, tokens, VALUES_PER_TOKEN, S.DTYPE
    )
    lmc.store(torch.tensor(token_ids, dtype=torch.long), want)
    lmc_fresh = lmcache_peer.LMCachePeer(
        workdir / "lmcache-stored", shape.layers, tokens, VALUES_PER_TOKEN, S.DTYPE
    )
    suite = S.suite_names(tenantkv)[0]
    # Warm and cold: no memory of recent writes (the page cache's case, then the device's).
    cache = S.TenantkvPrefix(
        tenantkv,
        workdir / "tenantkv",
        suite,
        shape,
        token_ids,
        want,
        open_kwargs={"recent_writes_bytes": 0},
    )
    # Just stored: the defaults, as deployed; each round stores the prefix under new tokens.
    fresh = S.TenantkvPrefix(
        tenantkv,
        workdir / "tenantkv-stored",
        suite,
        shape,
        token_ids,
        want,
        quota_bytes=(reps + 4) * shape.total_ct_bytes + 2**30,
    )
    # The lossy codecs, warm and cold (their store encodes, which a just-stored round would
    # time as much as the load): namespaces of their own, the same prefix stored in each.
    codec_caches = [
        S.TenantkvPrefix(
            tenantkv,
            workdir / f"tenantkv-{codec}",
            suite,
            shape,
            token_ids,
            want,
            open_kwargs={"recent_writes_bytes": 0},
            codec=codec,
        )
        for codec in CODECS
    ]
    stored_round = [0]

    def lmc_system(peer: Any) -> S.System:
        return S.System(
            "LMCache LocalDiskBackend",
            "lmcache",
            lambda: _timed(peer.load),
            lambda objs: [peer.layer_views(objs, layer) for layer in range(shape.layers)],
            release=peer.release,
            ttfl_is_total=True,
            note=f"{lmcache_peer.CHUNK_TOKENS}-token chunks, dst cpu",
        )

    raw = S.raw_systems(fds, offsets, bufs, pool, zero)[1]
    limit = S.encrypted_limit_system(enc_fd, bufs, shape, cipher, pool, zero)
    warm_kv = cache.systems(bufs, zero)[0]
    coded_kv = [(c.systems(bufs, zero)[0], c.root / "blocks" / "extents") for c in codec_caches]
    fresh_kv = fresh.systems(bufs, zero)[0]

    def rewrite_raw() -> None:
        # Store: the same bytes written again through the page cache (after dropping them, so
        # the load reads what the write left there, as LMCache's does).
        evict_files(paths)
        for fd, offset, layer in zip(fds, offsets, want, strict=True):
            pwrite_full(fd, byte_view(layer), offset)

    def rewrite_limit() -> None:
        evict_files([enc_path])
        S.write_encrypted_file(enc_path, want, shape, cipher)

    def store_lmcache() -> None:
        # The earlier rounds' chunks out of the page cache first: each round's would otherwise
        # stay there and crowd out the other systems' files on a machine short of memory.
        evict_files([workdir / "lmcache-stored"])
        stored_round[0] += 1
        ids = prefix_tokens(seed + 1000 + stored_round[0], tokens)
        lmc_fresh.store(torch.tensor(ids, dtype=torch.long), want)

    def store_tenantkv() -> None:
        stored_round[0] += 1
        fresh.restore(prefix_tokens(seed + 2000 + stored_round[0], tokens), want)

    nothing: Callable[[], None] = lambda: None  # noqa: E731
    extents = [cache.root / "blocks" / "extents"]
    run = ModesRun(shape, tuple(modes))
    table: dict[str, list[S.System]] = {
        "warm": [
            _with(raw, "warm", nothing),
            _with(limit, "warm", nothing),
            _with(lmc_system(lmc), "warm", nothing),
            _with(warm_kv, "warm", nothing),
            *(_with(system, "warm", nothing) for system, _ in coded_kv),
        ],
        "cold": [
            _with(raw, "cold", lambda: evict_files(paths)),
            _with(limit, "cold", lambda: evict_files([enc_path])),
            _with(lmc_system(lmc), "cold", lambda: evict_files([workdir / "lmcache"])),
            _with(warm_kv, "cold", lambda: evict_files(extents)),
            *(_with(system, "cold", _evicting(path)) for system, path in coded_kv),
        ],
        "stored": [
            _with(raw, "stored", rewrite_raw),
            _with(limit, "stored", rewrite_limit),
            _with(lmc_system(lmc_fresh), "stored", store_lmcache),
            _with(fresh_kv, "stored", store_tenantkv),
        ],
    }
    run.systems = {mode: table[mode] for mode in modes}
    try:
        # Warm-up: the warm mode's files into the page cache (tenantkv's were written past it),
        # each load checked; the other modes set up their own conditions before every load.
        print(f"{label} warm-up: one checked load of each warm system", flush=True)
        for system in run.systems.get("warm", []):
            one_load(system, want, timed=False)
        print(f"{label} timing {reps} rounds (modes and systems alternating) ...", flush=True)
        for r in range(reps):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                group = run.systems[mode]
                order = group if r % 2 == 0 else group[::-1]
                run.order.append([f"{mode}: {s.name}" for s in order])
                for system in order:
                    one_load(system, want, timed=True)
    finally:
        pool.close()
        cache.close()
        fresh.close()
        for coded in codec_caches:
            coded.close()
        lmc.close()
        lmc_fresh.close()
        for fd in (*fds, enc_fd):
            os.close(fd)
    return run


def _evicting(path: Path) -> Callable[[], None]:
    """A cold round's preparation: ``path``'s files out of the page cache."""
    return lambda: evict_files([path])


def _timed(load: Callable[[], Any]) -> tuple[Any, float, float]:
    import time

    t0 = time.perf_counter()
    got = load()
    t1 = time.perf_counter()
    return got, t1 - t0, t1 - t0


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def _stored(system: Any, nbytes: int) -> int:
    """The bytes ``system``'s files hold for a prefix of ``nbytes`` (fewer under a codec)."""
    return getattr(system, "stored_bytes", None) or nbytes


def _kept(mode: str, system: Any, nbytes: int) -> list[int]:
    """The rounds of ``system`` whose load read where ``mode`` says (all where unknown)."""
    fetched = system.cold_bytes or [None] * len(system.seconds)
    nbytes = _stored(system, nbytes)

    def as_intended(got: int | None) -> bool:
        if got is None:
            return True
        if mode == "cold":
            return got >= (1 - COLD_SLACK) * nbytes
        return got <= COLD_SLACK * nbytes

    return [i for i, got in enumerate(fetched) if as_intended(got)]


def _gbps(system: Any, nbytes: int, mode: str | None = None) -> list[float]:
    """GB/s of every timed load, or with ``mode`` of those that read where the mode says."""
    rounds = range(len(system.seconds)) if mode is None else _kept(mode, system, nbytes)
    return sorted(nbytes / system.seconds[i] / 1e9 for i in rounds)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return float("nan")
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _name(system: Any) -> str:
    return f"{system.name} [{system.note}]" if system.note else system.name


#: A warm or just-stored load that fetched more than this share of the prefix from the device
#: read partly cold (memory pressure evicted its files); a cold load that fetched less than
#: ``1 - COLD_SLACK`` of it was partly warm. Ratios involving such loads are flagged.
COLD_SLACK = 0.05


def targets(run: ModesRun) -> list[tuple[str, float, str, str]]:
    """(what, ratio of medians, target, verdict) for issue 35's targets of this run; the
    verdict says so where a load read from the device when it should not have, or the reverse
    (the ratio then measures something else)."""
    nbytes = run.shape.total_bytes
    med: dict[tuple[str, str], float] = {}
    fair: dict[tuple[str, str], bool] = {}
    for mode, systems in run.systems.items():
        for s in systems:
            med[(mode, s.group)] = _median(_gbps(s, nbytes, mode))
            fair[(mode, s.group)] = bool(_kept(mode, s, nbytes))
    out: list[tuple[str, float, str, str]] = []

    def add(what: str, num: tuple[str, str], den: tuple[str, str], target: float) -> None:
        if num in med and den in med:
            ratio = med[num] / med[den]
            verdict = "met" if ratio >= target else "NOT met"
            if not (fair[num] and fair[den]):
                verdict = "no round as intended (see `from storage`)"
            out.append((what, ratio, f">= {target:g}", verdict))

    add("cold: tenantkv / LMCache", ("cold", "tenantkv"), ("cold", "lmcache"), 0.95)
    add("cold: tenantkv / raw preadv", ("cold", "tenantkv"), ("cold", "raw"), 0.9)
    add("just stored: tenantkv / tenantkv warm", ("stored", "tenantkv"), ("warm", "tenantkv"), 0.8)
    add("warm: tenantkv / encrypted limit", ("warm", "tenantkv"), ("warm", "encrypted-limit"), 0.95)
    return out


def markdown(run: ModesRun, md_table: Callable[..., str]) -> str:
    """The section of BENCHMARKS.md for one size's modes."""
    nbytes = run.shape.total_bytes
    lines = [
        f"### {run.shape.tokens:,} tokens ({nbytes / 1e6:.1f} MB): warm, cold, just stored",
        "",
        "GB/s (min / median / max) over the rounds whose load read where its mode says:"
        " `from storage` gives, per round, the share of the prefix the timed load fetched from"
        " the device (`/proc/self/io` read_bytes; ~100% cold, 0% warm); a warm or just-stored"
        f" round above {COLD_SLACK:.0%} (memory pressure from the machine's other users had"
        f" evicted its files) or a cold round below {1 - COLD_SLACK:.0%} is left out of the"
        " figures and the ratios (`rounds`: kept of timed). `all rounds`: the median of"
        " every round, left-out ones included. tenantkv's `codec fp8` and `codec int4` rows"
        " (warm and cold) load the same prefix stored under a lossy codec into the same `out=`"
        " buffers, checked against the codec's own decode of its stored codes: their GB/s count"
        " the decoded prefix (so they compare tokens per second), their `from storage` the codes"
        " their files hold.",
        "",
    ]
    rows = []
    for mode, systems in run.systems.items():
        raw = next((s for s in systems if s.group == "raw"), None)
        raw_med = _median(_gbps(raw, nbytes, mode)) if raw is not None else float("nan")
        for s in systems:
            g = _gbps(s, nbytes, mode)
            kept = _kept(mode, s, nbytes)
            fetched = " ".join(f"{b / _stored(s, nbytes):.0%}" for b in s.cold_bytes)
            lo, med, hi = (g[0], _median(g), g[-1]) if g else (float("nan"),) * 3
            rows.append(
                [
                    MODE_TITLES[mode],
                    _name(s),
                    f"{lo:.2f}",
                    f"{med:.2f}",
                    f"{hi:.2f}",
                    f"{_median(_gbps(s, nbytes)):.2f}",
                    f"{_median([s.first_layer[i] for i in kept]) * 1e3:.1f}",
                    fetched,
                    f"{len(kept)} of {len(s.seconds)}",
                    f"{med / raw_med:.2f}",
                ]
            )
    lines.append(
        md_table(
            [
                "mode",
                "system",
                "min GB/s",
                "median GB/s",
                "max GB/s",
                "all rounds",
                "first layer ms",
                "from storage, per round",
                "rounds",
                "/ raw preadv",
            ],
            rows,
        )
    )
    lines += [
        "",
        md_table(
            ["target (ratio of medians, same run)", "ratio", "target", "verdict"],
            [[w, f"{r:.2f}", t, verdict] for w, r, t, verdict in targets(run)],
        ),
        "",
    ]
    return "\n".join(lines)


def as_json(run: ModesRun) -> dict[str, Any]:
    return {
        "tokens": run.shape.tokens,
        "bytes": run.shape.total_bytes,
        "order": run.order,
        "modes": {
            mode: [
                {
                    "name": _name(s),
                    "group": s.group,
                    "seconds": s.seconds,
                    "first_layer": s.first_layer,
                    "cold_bytes": s.cold_bytes,
                    "stored_bytes": getattr(s, "stored_bytes", None),
                }
                for s in systems
            ]
            for mode, systems in run.systems.items()
        },
        "targets": [
            {"what": w, "ratio": r, "target": t, "verdict": v} for w, r, t, v in targets(run)
        ],
    }


def from_json(data: dict[str, Any]) -> ModesRun:
    """A run back from :func:`as_json` (to write its tables again, measuring nothing)."""
    from types import SimpleNamespace

    tokens = int(data["tokens"])
    layers = round(int(data["bytes"]) / (tokens * VALUES_PER_TOKEN * 2))
    run = ModesRun(Shape(layers=layers, tokens=tokens), tuple(data["modes"]))
    run.order = data["order"]
    run.systems = {
        mode: [
            SimpleNamespace(
                name=row["name"],
                note="",
                group=row["group"],
                seconds=row["seconds"],
                first_layer=row["first_layer"],
                cold_bytes=row["cold_bytes"],
                stored_bytes=row.get("stored_bytes"),
            )
            for row in rows
        ]
        for mode, rows in data["modes"].items()
    }
    return run
