"""tenantkv gateway overhead: the latency it adds per request and its throughput, against a
stub OpenAI backend on loopback.

Three processes: a stub backend (uvicorn; instant JSON answers and a 3-event SSE stream), the
gateway in front of it, and this client. Each rep measures, round-robin in the same run:
- ``direct`` and ``gateway`` p50 latency of sequential non-streamed completions (the ratio is
  the gateway's added cost; the target is <= 2 ms added at p50);
- ``direct`` and ``gateway`` time to the first streamed byte (target <= 1 ms added);
- requests per second through the gateway with ``--clients`` concurrent clients (target >=
  1,000 req/s on 2 cores), and the same directly as the baseline.
All three processes share the machine's cores, so the throughput counts the client's load too.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from _cli import bench_parser, write_outputs
from _common import format_stats_table, print_machine
from _plots import median_bars, pyplot, save_figure
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

ROOT = Path(__file__).resolve().parent.parent
BODY = {"model": "m", "prompt": "You are a helpful assistant. " * 8 + "Hello", "max_tokens": 4}


def stub_app() -> Any:
    app = FastAPI()
    answer = {
        "id": "r",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "hi"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = json.loads(await request.body())
        if body.get("stream"):

            async def events() -> Any:
                for i in range(3):
                    yield f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return answer

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    return app


def gateway_app(backend: str) -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tenantkv.gateway import GatewayIdentity, GatewaySettings, create_gateway_app
    from tenantkv.tenant_assertion import AssertionSigner

    identity = GatewayIdentity("k1", "acme", "alice", "a" * 32)

    class Keys:
        def authenticate(self, secret: str) -> GatewayIdentity | None:
            return identity if secret == "bench-key" else None

    return create_gateway_app(
        Keys(),
        AssertionSigner(Ed25519PrivateKey.generate()),
        secret=b"s" * 32,
        backends=[backend],
        settings=GatewaySettings(audience="bench", max_concurrency_per_key=1000),
    )


def serve(kind: str, port: int, backend: str) -> None:
    import uvicorn

    app = stub_app() if kind == "stub" else gateway_app(backend)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def start(kind: str, port: int, backend: str = "") -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, str(port), backend], cwd=ROOT
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(
                f"http://127.0.0.1:{port}/healthz"
                if kind == "gateway"
                else f"http://127.0.0.1:{port}/health",
                timeout=1,
            )
            return proc
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{kind} did not start") from None
            time.sleep(0.1)


HEADERS = {"Authorization": "Bearer bench-key"}


def latency_ms(client: httpx.Client, url: str, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        client.post(url + "/v1/completions", json=BODY, headers=HEADERS).raise_for_status()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def first_byte_ms(client: httpx.Client, url: str, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        with client.stream(
            "POST", url + "/v1/completions", json={**BODY, "stream": True}, headers=HEADERS
        ) as answer:
            chunks = answer.iter_raw()
            next(chunks)
            times.append(time.perf_counter() - t)
            for _chunk in chunks:
                pass
    return statistics.median(times) * 1e3


async def throughput(url: str, clients: int, total: int) -> float:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        left = total

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                answer = await client.post(url + "/v1/completions", json=BODY, headers=HEADERS)
                answer.raise_for_status()

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return total / (time.perf_counter() - t)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    parser = bench_parser(__doc__, reps=3, data_dir=False)
    parser.add_argument("--requests", type=int, default=200, help="sequential requests per rep")
    parser.add_argument("--clients", type=int, default=100, help="concurrent clients")
    parser.add_argument("--total", type=int, default=2000, help="requests per throughput rep")
    parser.add_argument("--port", type=int, default=18470, help="first of two loopback ports")
    args = parser.parse_args()
    machine = print_machine(".")
    stub_url, gw_url = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.port + 1}"
    procs = [start("stub", args.port)]
    procs.append(start("gateway", args.port + 1, stub_url))
    samples: dict[str, list[float]] = {}
    try:
        with httpx.Client(timeout=30) as client:
            for url in (stub_url, gw_url):  # warm both paths
                latency_ms(client, url, 20)
            for _ in range(args.reps):
                for name, url in (("direct", stub_url), ("gateway", gw_url)):
                    samples.setdefault(f"p50 latency, {name}", []).append(
                        latency_ms(client, url, args.requests)
                    )
                    samples.setdefault(f"first byte, {name}", []).append(
                        first_byte_ms(client, url, args.requests)
                    )
                    samples.setdefault(f"req/s x{args.clients}, {name}", []).append(
                        asyncio.run(throughput(url, args.clients, args.total))
                    )
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    added = {
        "p50 added ms": [
            g - d
            for g, d in zip(
                samples["p50 latency, gateway"], samples["p50 latency, direct"], strict=True
            )
        ],
        "first byte added ms": [
            g - d
            for g, d in zip(
                samples["first byte, gateway"], samples["first byte, direct"], strict=True
            )
        ],
        "req/s ratio gateway/direct": [
            g / d
            for g, d in zip(
                samples[f"req/s x{args.clients}, gateway"],
                samples[f"req/s x{args.clients}, direct"],
                strict=True,
            )
        ],
    }
    rows = [(name, values, "") for name, values in {**samples, **added}.items()]
    print(format_stats_table(rows, "", label=f"metric ({args.reps} reps, ms or req/s)"))

    def plot(path: Path) -> None:
        plt = pyplot()
        fig, axes = plt.subplots(1, 3, figsize=(12, 4))
        groups = (("p50 latency", "ms"), ("first byte", "ms"), (f"req/s x{args.clients}", "req/s"))
        for ax, (prefix, unit) in zip(axes, groups, strict=True):
            names = ["direct", "gateway"]
            median_bars(ax, range(2), [samples[f"{prefix}, {n}"] for n in names], color="#1f77b4")
            ax.set_xticks(range(2), names)
            ax.set_title(prefix, fontsize=9)
            ax.set_ylabel(f"{unit}; median, bars = min/max")
        save_figure(fig, path)

    write_outputs(
        args.out, "gateway", {"machine": machine, "samples": samples, "added": added}, plot
    )


if __name__ == "__main__":
    main()
