"""A real local stack for the gateway's tests: a recording OpenAI-shaped backend and the
gateway, each served by uvicorn on 127.0.0.1 in a thread of the test process."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tenantkv.gateway import GatewayIdentity

#: What the backend puts in its answers that must never reach a client.
LEAKS = {"kv_transfer_params": {"tenantkv_assertion": "leaked"}, "tenantkv_debug": "leaked"}


class DictAuthenticator:
    """Test double of the inference-key service: secret -> identity; anything else None."""

    def __init__(self, keys: dict[str, GatewayIdentity]) -> None:
        self.keys = keys

    def authenticate(self, secret: str) -> GatewayIdentity | None:
        return self.keys.get(secret)


@dataclass
class Recording:
    """What one backend received, and what became of its streams."""

    name: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    healthy: bool = True


def recording_backend(rec: Recording) -> FastAPI:
    """OpenAI-shaped answers; the model name picks a behaviour: ``hang`` never answers,
    ``fail`` is a 500 with a traceback text, ``unknown`` a 404, ``slow`` streams 40 chunks
    0.1 s apart."""
    app = FastAPI()

    async def answer(request: Request, kind: str) -> Any:
        body = json.loads(await request.body())
        rec.requests.append(
            {"path": request.url.path, "headers": dict(request.headers), "body": body}
        )
        model = body.get("model")
        if model == "hang":
            await asyncio.sleep(3600)
        if model == "fail":
            return PlainTextResponse("Traceback (most recent call last): secret internals", 500)
        if model == "unknown":
            return JSONResponse(
                {
                    "error": {"message": "The model `unknown` does not exist.", "code": 404},
                    "kv_transfer_params": {"x": 1},
                },
                status_code=404,
            )
        usage = {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 2},
        }
        if body.get("stream"):
            chunks = 40 if model == "slow" else 3
            delay = 0.1 if model == "slow" else 0.05
            tag = body.get("tag", "")

            async def events() -> AsyncIterator[bytes]:
                try:
                    for i in range(chunks):
                        chunk = {
                            "id": "c",
                            "object": kind,
                            "choices": [{"index": 0, "text": f"t{i}"}],
                            **LEAKS,
                        }
                        yield f"data: {json.dumps(chunk)}\n\n".encode()
                        await asyncio.sleep(delay)
                    final = {"id": "c", "object": kind, "choices": [], "usage": usage, **LEAKS}
                    yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode()
                    rec.completed.append(tag)
                except BaseException:
                    rec.cancelled.append(tag)
                    raise

            return StreamingResponse(events(), media_type="text/event-stream")
        return {
            "id": "r",
            "object": kind,
            "backend": rec.name,
            "choices": [{"index": 0, "text": "hello", "kv_transfer_params": {"a": 1}}],
            "usage": usage,
            **LEAKS,
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await answer(request, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await answer(request, "chat.completion")

    @app.get("/health")
    async def health() -> Any:
        return PlainTextResponse("", 200 if rec.healthy else 503)

    return app


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port in a thread; its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def dead_url() -> str:
    """A loopback URL where nothing listens (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
