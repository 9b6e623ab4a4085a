"""Two ``vllm serve`` backends behind one gateway, the gateway run as an operator runs it:
``tenantkv gateway --config FILE`` in a child process, the file naming both backends.

* affinity: a tenant's repeated prompt goes to one backend, which serves it from its prefix
  cache (cached tokens on the repeat), and the other backend's own metrics show it never got
  the request;
* failover: with that backend stopped, the same prompt still succeeds through the gateway,
  served by the other, and still from cache: the connector of the stopped node had stored it
  in tenantkv, which every node shares.

The first backend is the session's (tests_engines/hosted.py); the second (the one the test
stops) is started with it when this module is collected, so that the two starts overlap. The
test picks a prompt that the gateway's rendezvous ranks on the second, then checks with the
backends' metrics where the requests really went.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tenantkv.cli.gateway import gateway_options
from tenantkv.gateway.keyed import affinity_digest
from tenantkv.gateway.routing import Router
from tests.ports import free_ports
from tests_engines.hosted import (
    BLOCK,
    MODEL,
    REPO,
    Stack,
    start_vllm,
    stop,
    wait_until_healthy,
    write_config,
)

GATEWAY_START_TIMEOUT = 60.0


@dataclass(frozen=True)
class Pair:
    gateway: str
    first: str  # the session's backend
    second: str  # the test's own, which it stops
    second_process: subprocess.Popen[bytes]


def served_requests(backend: str) -> float:
    """The requests ``backend`` finished, from its Prometheus metrics."""
    text = httpx.get(backend + "/metrics", timeout=10).text
    samples = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    ]
    assert samples, "vllm serve exposes no vllm:request_success_total"
    return sum(samples)


def cached_completion(gateway: str, key: str, text: str) -> int:
    """A greedy completion through the official client; its cached prompt tokens."""
    client = openai.OpenAI(base_url=gateway + "/v1", api_key=key, max_retries=0, timeout=60)
    done = client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0)
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    cached = done.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and len(done.choices) == 1
    return cached


@pytest.fixture
def two_backends(hosted_stack: Stack, tmp_path: Path) -> Iterator[Pair]:
    """The gateway, a child process of ``tenantkv gateway --config FILE``, in front of the
    session's backend and a second one."""
    if hosted_stack.spare is not None:  # started with the session's, its start overlapped
        second, backend = hosted_stack.spare.url, hosted_stack.spare.process
        vllm_log = hosted_stack.spare.log
        (gateway_port,) = free_ports(1)
    else:
        port, gateway_port = free_ports(2)  # the second backend's and the gateway's
        second = f"http://127.0.0.1:{port}"
        vllm_log = tmp_path / "vllm-2.log"
        backend = start_vllm(hosted_stack.model, port, hosted_stack.config_file, vllm_log)
    config = tmp_path / "tenantkv.toml"
    base = hosted_stack.config_file.parent  # the key, public key and secret files
    write_config(
        config,
        Path(hosted_stack.kv.config.root),
        hosted_stack.database_url,
        base,
        backends=[hosted_stack.vllm, second],
        port=gateway_port,
    )
    gateway_log = tmp_path / "gateway.log"
    with gateway_log.open("wb") as out:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "tenantkv.cli", "gateway", "--config", str(config)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{gateway_port}"
    try:
        deadline = time.monotonic() + GATEWAY_START_TIMEOUT
        while True:
            assert gateway.poll() is None, gateway_log.read_text(errors="replace")
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway did not come up"
            time.sleep(0.2)
        wait_until_healthy(backend, second, vllm_log)
        yield Pair(url, hosted_stack.vllm, second, backend)
    finally:
        stop(gateway)
        stop(backend)


def test_affinity_keeps_a_prefix_on_one_backend_and_failover_moves_it(
    hosted_stack: Stack, two_backends: Pair
) -> None:
    pair = two_backends
    gateway, first, second = pair.gateway, pair.first, pair.second
    key = hosted_stack.keys["acme"]
    identity = hosted_stack.kv.inference_keys.authenticate(key)
    assert identity is not None
    settings = gateway_options(".", config_file=str(hosted_stack.config_file)).settings
    router = Router([first, second], cooldown=settings.backend_cooldown)

    def ranked_first(text: str) -> str:
        body = {"model": MODEL, "prompt": text}
        digest = affinity_digest(
            b"g" * 32,  # tests_engines/hosted.py's SECRET, the file both gateways read
            identity,
            body,
            chars=settings.affinity_chars,
            messages=settings.affinity_messages,
        )
        return router.rank(digest)[0]

    # a prompt of acme's that the gateway ranks on the second backend (the one we may stop)
    text = next(
        t
        for t in (f"[two-{i}] " + "Route me to my own backend, please. " * 3 for i in range(64))
        if ranked_first(t) == second
    )
    before = {url: served_requests(url) for url in (first, second)}
    assert cached_completion(gateway, key, text) == 0
    repeat = cached_completion(gateway, key, text)
    assert repeat > 0 and repeat % BLOCK == 0  # the second backend's prefix cache
    after = {url: served_requests(url) for url in (first, second)}
    assert after[second] - before[second] == 2  # both went to the second backend ...
    assert after[first] == before[first]  # ... and the first never got either

    # control of the affinity reading: a prompt ranked on the first backend goes there
    other = next(
        t
        for t in (f"[two-first-{i}] " + "Route me elsewhere. " * 3 for i in range(64))
        if ranked_first(t) == first
    )
    cached_completion(gateway, key, other)
    assert served_requests(first) == after[first] + 1

    # failover: the second backend goes away; the gateway moves the prompt to the first
    stop(pair.second_process)
    moved = cached_completion(gateway, key, text)
    assert served_requests(first) == after[first] + 2
    assert moved == repeat  # served from tenantkv, which the stopped node had filled
