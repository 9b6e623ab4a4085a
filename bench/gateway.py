"""tenantkv gateway overhead: the latency it adds per request and its throughput, against a
stub OpenAI backend on loopback.

Processes: a stub backend (uvicorn, a bare Starlette app: pre-encoded JSON answers and a
3-event SSE stream), the gateway in front of it (uvicorn as ``tenantkv gateway`` runs it), and
the load generator (this script, plus ``--load-procs`` children for the throughput runs). Each
rep measures, round-robin in the same run:
- ``direct`` and ``gateway`` p50 latency of sequential non-streamed completions on one
  keep-alive connection (the difference is the gateway's added cost; target <= 2 ms at p50);
- ``direct`` and ``gateway`` time to the first byte of a streamed answer's body (target <= 1 ms
  added);
- requests per second with ``--clients`` concurrent keep-alive connections through the gateway
  (target >= 1,000 req/s on 2 cores), and the same directly as the baseline.
The load generator speaks HTTP/1.1 over asyncio streams with a pre-encoded request, so that the
client costs a few tens of microseconds per request: a general-purpose client (httpx's async
pool is quadratic in its connections) would measure itself rather than the servers. All the
processes share the machine's cores, so the throughput counts the client's load too; the load
average before and after the run is printed with the results.

CPU per request: during each throughput rep the CPU time (user + system) of the stub, the
gateway and the load generator is read (psutil, process_time) and divided by the requests. On a
machine shared with other work these are steadier than the rates: they say what each process
costs, not how much of the cores it was given.

``--compare-rev REV`` serves a second gateway from the package as it was at git revision REV
(``git archive`` into a temporary directory, put first on the server's PYTHONPATH) and measures
it round-robin with the others as ``gateway@REV``: before and after in the same run.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from _cli import bench_parser, write_outputs
from _common import format_stats_table, print_machine
from _plots import median_bars, pyplot, save_figure

ROOT = Path(__file__).resolve().parent.parent
BODY = {"model": "m", "prompt": "You are a helpful assistant. " * 8 + "Hello", "max_tokens": 4}
KEY = "bench-key"


def stub_app() -> Any:
    """A backend that costs as little as a Python server can: the answer is encoded once."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    answer = json.dumps(
        {
            "id": "r",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "hi"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }
    ).encode()
    events = [f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode() for i in range(3)]
    events.append(b"data: [DONE]\n\n")

    async def completions(request: Request) -> Response:
        if json.loads(await request.body()).get("stream"):

            async def stream() -> Any:
                for event in events:
                    yield event

            return StreamingResponse(stream(), media_type="text/event-stream")
        return Response(answer, media_type="application/json")

    async def health(_: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health),
            Route("/healthz", health),
        ]
    )


def gateway_app(backend: str) -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tenantkv.gateway import GatewayIdentity, GatewaySettings, create_gateway_app
    from tenantkv.tenant_assertion import AssertionSigner

    identity = GatewayIdentity("k1", "acme", "alice", "a" * 32)

    class Keys:
        def authenticate(self, secret: str) -> GatewayIdentity | None:
            return identity if secret == KEY else None

    return create_gateway_app(
        Keys(),
        AssertionSigner(Ed25519PrivateKey.generate()),
        secret=b"s" * 32,
        backends=[backend],
        settings=GatewaySettings(audience="bench", max_concurrency_per_key=1000),
    )


def serve(kind: str, port: int, backend: str) -> None:
    """Serve like ``tenantkv gateway`` does (uvicorn picks httptools and uvloop if installed)."""
    import uvicorn

    app = stub_app() if kind == "stub" else gateway_app(backend)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def start(
    kind: str, port: int, backend: str = "", package_dir: str | None = None
) -> subprocess.Popen[bytes]:
    """Serve ``kind`` in a child process; tenantkv from ``package_dir`` when given."""
    env = dict(os.environ)
    if package_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_dir, env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, str(port), backend], cwd=ROOT, env=env
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return proc
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{kind} did not start") from None
            time.sleep(0.1)


# ------------------------------------------------------------------ the load generator


def request_bytes(port: int, *, stream: bool) -> bytes:
    body = json.dumps({**BODY, "stream": True} if stream else BODY).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def read_head(reader: asyncio.StreamReader) -> tuple[int | None, bool]:
    """The answer's Content-Length (None when chunked) after checking it is a 200."""
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"answer {status!r}")
    length, chunked = None, False
    while (line := await reader.readline()) != b"\r\n":
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if length is None and not chunked:
        raise RuntimeError("an answer of unknown length")
    return length, chunked


async def read_chunk(reader: asyncio.StreamReader) -> int:
    """One chunk of a chunked body; its size (0 for the last)."""
    size = int((await reader.readline()).split(b";")[0], 16)
    await reader.readexactly(size + 2)
    if size == 0:
        return 0
    return size


async def exchange(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    request: bytes,
) -> float:
    """Send one request; read the whole answer; the seconds to the first byte of its body."""
    t = time.perf_counter()
    writer.write(request)
    length, chunked = await read_head(reader)
    if chunked:
        await read_chunk(reader)
        first = time.perf_counter() - t
        while await read_chunk(reader):
            pass
    else:
        await reader.readexactly(length or 0)
        first = time.perf_counter() - t
    return first


async def sequential_ms(port: int, n: int, *, stream: bool) -> float:
    """p50 ms of ``n`` sequential requests on one keep-alive connection: the whole answer when
    not streamed, the first byte of the body when streamed."""
    request = request_bytes(port, stream=stream)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            first = await exchange(reader, writer, request)
            times.append(first if stream else time.perf_counter() - t)
    finally:
        writer.close()
    return statistics.median(times) * 1e3


async def _load(port: int, clients: int, total: int) -> tuple[int, float]:
    request = request_bytes(port, stream=False)
    left = total

    async def worker() -> int:
        nonlocal left
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        done = 0
        try:
            while left > 0:
                left -= 1
                await exchange(reader, writer, request)
                done += 1
        finally:
            writer.close()
        return done

    t = time.perf_counter()
    done = sum(await asyncio.gather(*(worker() for _ in range(clients))))
    return done, time.perf_counter() - t


def load_process(port: int, clients: int, total: int) -> tuple[int, float, float]:
    """Requests done, seconds, and the CPU seconds this load process used."""
    cpu = time.process_time()
    done, seconds = asyncio.run(_load(port, clients, total))
    return done, seconds, time.process_time() - cpu


def cpu_seconds(proc: subprocess.Popen[bytes]) -> float:
    import psutil

    times = psutil.Process(proc.pid).cpu_times()
    return times.user + times.system


def throughput(
    pool: ProcessPoolExecutor, procs: int, port: int, clients: int, total: int
) -> tuple[float, int, float]:
    """Requests per second of ``clients`` connections spread over ``procs`` processes; the
    requests done and the load generator's CPU seconds."""
    shares = [clients // procs + (i < clients % procs) for i in range(procs)]
    jobs = [pool.submit(load_process, port, c, total * c // clients) for c in shares if c]
    results = [job.result() for job in jobs]
    done = sum(r[0] for r in results)
    return done / max(r[1] for r in results), done, sum(r[2] for r in results)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    parser = bench_parser(__doc__, reps=3, data_dir=False)
    parser.add_argument("--requests", type=int, default=500, help="sequential requests per rep")
    parser.add_argument("--clients", type=int, default=100, help="concurrent connections")
    parser.add_argument("--total", type=int, default=5000, help="requests per throughput rep")
    parser.add_argument("--load-procs", type=int, default=1, help="load generator processes")
    parser.add_argument("--port", type=int, default=18470, help="first of three loopback ports")
    parser.add_argument(
        "--compare-rev", default=None, help="also serve the gateway as of this git revision"
    )
    args = parser.parse_args()
    machine = print_machine(".", load_before=" ".join(f"{x:.2f}" for x in os.getloadavg()))
    stub_port, gw_port, old_port = args.port, args.port + 1, args.port + 2
    backend = f"http://127.0.0.1:{stub_port}"
    stub = start("stub", stub_port)
    servers = {
        "direct": (stub_port, stub),
        "gateway": (gw_port, start("gateway", gw_port, backend)),
    }
    old_dir = tempfile.TemporaryDirectory(prefix="tenantkv-gateway-")
    if args.compare_rev:
        # the package as it was (its tenantkv.crypto/storage/audit too, which the editable
        # install maps from the top level), first on the old server's path
        machine["compare_rev"] = subprocess.run(
            ["git", "rev-parse", "--short", args.compare_rev],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        archive = subprocess.run(
            ["git", "archive", args.compare_rev, "tenantkv", "crypto", "storage", "audit"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", old_dir.name], input=archive, check=True)
        for sub in ("crypto", "storage", "audit"):
            os.rename(os.path.join(old_dir.name, sub), os.path.join(old_dir.name, "tenantkv", sub))
        servers[f"gateway@{machine['compare_rev']}"] = (
            old_port,
            start("gateway", old_port, backend, package_dir=old_dir.name),
        )
    samples: dict[str, list[float]] = {}
    names = list(servers)
    n = args.clients
    try:
        with ProcessPoolExecutor(args.load_procs) as pool:
            for port, _ in servers.values():  # warm every path and the pool's processes
                asyncio.run(sequential_ms(port, 50, stream=False))
                throughput(pool, args.load_procs, port, n, n * 2)
            for rep in range(args.reps):
                # alternate the order, so neither path always runs first after the other
                order = names if rep % 2 == 0 else names[::-1]
                for name in order:
                    port, proc = servers[name]
                    samples.setdefault(f"p50 latency, {name}", []).append(
                        asyncio.run(sequential_ms(port, args.requests, stream=False))
                    )
                    samples.setdefault(f"first byte, {name}", []).append(
                        asyncio.run(sequential_ms(port, args.requests, stream=True))
                    )
                    server_cpu = cpu_seconds(proc)
                    stub_cpu = cpu_seconds(stub)
                    rate, done, client_cpu = throughput(pool, args.load_procs, port, n, args.total)
                    samples.setdefault(f"req/s x{n}, {name}", []).append(rate)
                    if name != "direct":
                        samples.setdefault(f"CPU us/req x{n}: {name} process", []).append(
                            (cpu_seconds(proc) - server_cpu) / done * 1e6
                        )
                    samples.setdefault(f"CPU us/req x{n}: stub, via {name}", []).append(
                        (cpu_seconds(stub) - stub_cpu) / done * 1e6
                    )
                    samples.setdefault(f"CPU us/req x{n}: client, via {name}", []).append(
                        client_cpu / done * 1e6
                    )
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.wait(10)
        old_dir.cleanup()
    machine["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average before {machine['load_before']}, after {machine['load_after']}")
    added: dict[str, list[float]] = {}
    for name in names[1:]:
        added |= _versus_direct(samples, name, n)
    rows = [(name, values, "") for name, values in {**samples, **added}.items()]
    print(format_stats_table(rows, "", label=f"metric ({args.reps} reps, ms or req/s)"))

    def plot(path: Path) -> None:
        plt = pyplot()
        fig, axes = plt.subplots(1, 4, figsize=(16, 4))
        groups = (
            ("p50 latency, {}", "ms"),
            ("first byte, {}", "ms"),
            (f"req/s x{n}, {{}}", "req/s"),
            (f"CPU us/req x{n}: {{}} process", "CPU us per request"),
        )
        for ax, (pattern, unit) in zip(axes, groups, strict=True):
            shown = [name for name in names if pattern.format(name) in samples]
            median_bars(
                ax, range(len(shown)), [samples[pattern.format(s)] for s in shown], color="#1f77b4"
            )
            ax.set_xticks(range(len(shown)), shown, fontsize=7)
            ax.set_title(
                pattern.format("each").replace(", each", "").replace(": each", ":"), fontsize=9
            )
            ax.set_ylabel(f"{unit}; median, bars = min/max")
        save_figure(fig, path)

    write_outputs(
        args.out, "gateway", {"machine": machine, "samples": samples, "added": added}, plot
    )


def _versus_direct(samples: dict[str, list[float]], name: str, n: int) -> dict[str, list[float]]:
    """What the gateway ``name`` adds to direct calls, rep by rep (same-run differences)."""

    def pairs(metric: str) -> list[tuple[float, float]]:
        return list(zip(samples[f"{metric}, {name}"], samples[f"{metric}, direct"], strict=True))

    return {
        f"p50 added ms, {name}": [g - d for g, d in pairs("p50 latency")],
        f"first byte added ms, {name}": [g - d for g, d in pairs("first byte")],
        f"req/s ratio {name}/direct": [g / d for g, d in pairs(f"req/s x{n}")],
    }


if __name__ == "__main__":
    main()
