"""Admin API throughput and latency: 16 concurrent keep-alive clients against a real uvicorn
server on loopback, serving the embedded default database (``tenantkv.open(root)``: SQLite).

Each rep runs two phases with the same clients, in this order:
- ``healthz only``: every request is ``GET /healthz`` (no auth, no database): the baseline;
- ``mixed``: 80% reads (get / list tenants, usage, healthz), 20% writes (PATCH retention or
  quota within capacity, key rotation), all with an operator token.

Only loopback traffic; every phase stops after ``--seconds`` or ``--max-requests``, whichever
comes first. Non-2xx answers and transport errors are counted as errors (expected: 0).
"""

from __future__ import annotations

import argparse
import random
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _cli import bench_parser
from _common import format_stats_table, print_kv, print_machine
from _plots import median_bars, pyplot, save_figure

TENANTS = ("acme", "globex", "initech", "umbrella")
MiB = 2**20
# (kind, weight %): 80% reads, 20% writes
MIX = (
    ("GET /v1/tenants/{name}", 30),
    ("GET /v1/tenants", 15),
    ("GET /v1/tenants/{name}/usage", 20),
    ("GET /healthz", 15),
    ("PATCH /v1/tenants/{name}", 15),
    ("POST /v1/tenants/{name}/keys/rotate", 5),
)
WRITES = {"PATCH /v1/tenants/{name}", "POST /v1/tenants/{name}/keys/rotate"}
PERCENTILES = (50, 90, 99)


# --------------------------------------------------------------------------- #
# Server (a subprocess, so the clients' GIL does not slow it down)
# --------------------------------------------------------------------------- #


def serve(root: str, port: int) -> None:
    import uvicorn

    import tenantkv
    from tenantkv.server.app import create_app
    from tenantkv.server.settings import Settings

    with tenantkv.open(root) as kv:
        app = create_app(kv, Settings(root=root, port=port))
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prepare(root: str) -> tuple[str, dict[str, str]]:
    """Create the tenants and an operator token; return the token and the database's details."""
    import tenantkv

    with tenantkv.open(root) as kv:
        token = kv.tokens.ensure_first_operator()
        assert token is not None
        for name in TENANTS:
            kv.create_tenant(name, quota_bytes=256 * MiB, retention={"agent": "1d"})
        url = kv.context.index.engine.url
        db = {
            "database": f"{url.get_backend_name()} ({url.render_as_string(hide_password=True)})",
            "sqlite": sqlite3.sqlite_version,
            "durable": "yes (tenantkv.open default)",
            "capacity": f"{kv.capacity_bytes / 2**30:.1f} GiB",
        }
    return token, db


def start_server(root: str, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", root, "--port", str(port)]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not start within 30 s")
        time.sleep(0.05)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- #
# Clients
# --------------------------------------------------------------------------- #


@dataclass
class Phase:
    """One phase of one rep: latencies (s) per kind, errors per kind, wall time."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    error_samples: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.latencies.values())

    def rps(self, kind: str | None = None) -> float:
        n = self.total if kind is None else len(self.latencies.get(kind, []))
        return n / self.seconds

    def percentile(self, kind: str, p: float) -> float:
        values = sorted(self.latencies[kind])
        return values[min(len(values) - 1, int(p / 100 * len(values)))]


def one_request(client: httpx.Client, kind: str, rng: random.Random) -> httpx.Response:
    name = rng.choice(TENANTS)
    if kind == "GET /v1/tenants/{name}":
        return client.get(f"/v1/tenants/{name}")
    if kind == "GET /v1/tenants":
        return client.get("/v1/tenants")
    if kind == "GET /v1/tenants/{name}/usage":
        return client.get(f"/v1/tenants/{name}/usage")
    if kind == "GET /healthz":
        return client.get("/healthz")
    if kind == "PATCH /v1/tenants/{name}":
        if rng.random() < 0.5:
            body: dict[str, object] = {"retention": {"agent": f"{rng.randint(1, 7)}d"}}
        else:
            body = {"quota_bytes": rng.randint(64, 512) * MiB}  # 4 x 512 MiB fits the capacity
        return client.patch(f"/v1/tenants/{name}", json=body)
    if kind == "POST /v1/tenants/{name}/keys/rotate":
        return client.post(f"/v1/tenants/{name}/keys/rotate")
    raise ValueError(kind)


def run_phase(
    base: str,
    token: str,
    mix: tuple[tuple[str, int], ...],
    clients: int,
    seconds: float,
    max_requests: int,
    seed: int,
) -> Phase:
    phase = Phase()
    lock = threading.Lock()
    start_box: list[float] = []
    barrier = threading.Barrier(clients + 1, action=lambda: start_box.append(time.perf_counter()))
    per_client = max(1, max_requests // clients)
    kinds = [k for k, _ in mix]
    weights = [w for _, w in mix]
    ends: list[float] = []

    def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        lat: dict[str, list[float]] = defaultdict(list)
        err: dict[str, int] = defaultdict(int)
        samples: list[str] = []
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=base, headers=headers, timeout=10) as client:
            client.get("/healthz")  # open the keep-alive connection before the clock starts
            barrier.wait()
            deadline = start_box[0] + seconds
            for _ in range(per_client):
                kind = rng.choices(kinds, weights)[0]
                t0 = time.perf_counter()
                try:
                    response = one_request(client, kind, rng)
                    ok = 200 <= response.status_code < 300
                    why = f"{response.status_code} {response.text[:120]}"
                except httpx.HTTPError as exc:
                    ok, why = False, repr(exc)
                t1 = time.perf_counter()
                lat[kind].append(t1 - t0)
                if not ok:
                    err[kind] += 1
                    if len(samples) < 3:
                        samples.append(f"{kind}: {why}")
                if t1 >= deadline:
                    break
        with lock:
            ends.append(t1)
            for k, v in lat.items():
                phase.latencies[k].extend(v)
            for k, n in err.items():
                phase.errors[k] += n
            phase.error_samples.extend(samples[: max(0, 5 - len(phase.error_samples))])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    phase.seconds = max(ends) - start_box[0]
    return phase


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def plot(mixed: list[Phase], health: list[Phase], path: Path, title: str) -> None:
    rows = [(k, mixed) for k, _ in MIX] + [("healthz only (baseline)", health)]
    fig, ax = pyplot().subplots(figsize=(10, 5))
    width = 0.8 / len(PERCENTILES)
    for j, p in enumerate(PERCENTILES):
        samples = [
            [ph.percentile("GET /healthz" if phases is health else kind, p) * 1e3 for ph in phases]
            for kind, phases in rows
        ]
        xs = [i + (j - (len(PERCENTILES) - 1) / 2) * width for i in range(len(rows))]
        median_bars(ax, xs, samples, width, capsize=2, edgecolor=None, label=f"p{p}")
    ax.set_xticks(range(len(rows)), [k for k, _ in rows], rotation=25, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("latency, ms (median over reps; whiskers min/max)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.set_axisbelow(True)
    save_figure(fig, path)


def main() -> int:
    parser = bench_parser(__doc__, reps=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each phase")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument(
        "--max-requests", type=int, default=1_000_000, help="cap on requests per phase"
    )
    parser.add_argument("--warmup", type=float, default=1.0, help="untimed mixed phase, seconds")
    parser.add_argument("--serve", metavar="ROOT", help=argparse.SUPPRESS)  # internal
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return 0

    health_mix = (("GET /healthz", 100),)
    with tempfile.TemporaryDirectory(prefix="tkv-admin-bench-", dir=args.dir) as tmp:
        root = str(Path(tmp) / "cache")
        info = print_machine(tmp)
        token, db = prepare(root)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        print_kv("database", db)
        print(
            f"server: uvicorn subprocess on {base} (1 worker); {args.clients} client threads, "
            f"one keep-alive httpx.Client each; {len(TENANTS)} tenants; "
            f"{args.seconds:g} s per phase x {args.reps} reps (cap {args.max_requests} requests)"
        )
        print("mix: " + ", ".join(f"{k} {w}%" for k, w in MIX) + "\n")
        proc = start_server(root, port)
        mixed: list[Phase] = []
        health: list[Phase] = []
        try:
            if args.warmup > 0:
                run_phase(base, token, MIX, args.clients, args.warmup, args.max_requests, 999)
            for rep in range(args.reps):
                health.append(
                    run_phase(
                        base, token, health_mix, args.clients, args.seconds, args.max_requests, rep
                    )
                )
                mixed.append(
                    run_phase(base, token, MIX, args.clients, args.seconds, args.max_requests, rep)
                )
                print(
                    f"rep {rep + 1}/{args.reps}: healthz only {health[-1].rps():,.0f} req/s, "
                    f"mixed {mixed[-1].rps():,.0f} req/s",
                    flush=True,
                )
        finally:
            stop_server(proc)
    print()

    def errs(phases: list[Phase], kind: str | None = None) -> int:
        return sum(
            sum(ph.errors.values()) if kind is None else ph.errors.get(kind, 0) for ph in phases
        )

    def count(phases: list[Phase], kind: str | None = None) -> int:
        return sum(ph.total if kind is None else len(ph.latencies[kind]) for ph in phases)

    def note(phases: list[Phase], kind: str | None = None) -> str:
        return f"{count(phases, kind):>8}  {errs(phases, kind):>6}"

    rps_rows: list[tuple[str, list[float], str]] = [
        ("mixed: all", [ph.rps() for ph in mixed], note(mixed))
    ]
    rps_rows += [(f"  {k}", [ph.rps(k) for ph in mixed], note(mixed, k)) for k, _ in MIX]
    rps_rows.append(
        ("  reads", [sum(ph.rps(k) for k, _ in MIX if k not in WRITES) for ph in mixed], "")
    )
    rps_rows.append(("  writes", [sum(ph.rps(k) for k in WRITES) for ph in mixed], ""))
    rps_rows.append(("healthz only", [ph.rps() for ph in health], note(health)))
    print("throughput (requests/s; min/median/max over reps; requests and errors summed)")
    print(
        format_stats_table(
            rps_rows, "req/s", label="kind", digits=1, note_header="requests  errors"
        )
    )
    print()

    for p in (50, 99):
        lat_rows = [(k, [ph.percentile(k, p) * 1e3 for ph in mixed], "") for k, _ in MIX] + [
            ("healthz only", [ph.percentile("GET /healthz", p) * 1e3 for ph in health], "")
        ]
        print(f"latency p{p} (ms; min/median/max over reps)")
        print(format_stats_table(lat_rows, "ms", label="kind", digits=2))
        print()

    ratios = [m.rps() / h.rps() for m, h in zip(mixed, health, strict=True)]
    print("ratio (same rep)")
    print(format_stats_table([("mixed req/s / healthz-only req/s", ratios, "")], "ratio", digits=3))
    print()
    total_errors = errs(mixed) + errs(health)
    print(f"errors (non-2xx or transport): {total_errors}")
    for ph in mixed + health:
        for sample in ph.error_samples:
            print(f"  e.g. {sample}")

    png = args.out / "admin_api.png"
    plot(
        mixed,
        health,
        png,
        f"tenantkv admin API, {args.clients} clients, SQLite (durable), {args.reps} reps x "
        f"{args.seconds:g} s; {info['cpu']}, {info['cores']}",
    )
    print(f"plot: {png}")
    return 1 if total_errors else 0


if __name__ == "__main__":
    sys.exit(main())
