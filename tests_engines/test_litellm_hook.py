"""tenantkv's LiteLLM hook end to end on CPU: the official ``openai`` client calls LiteLLM's proxy
(``litellm[proxy]==1.106.12`` from .venv-litellm, a child process on 127.0.0.1; keys and teams
by LiteLLM's ``custom_auth``, see tests_engines/litellm_proxy.py) whose callback is
``tenantkv.integrations.litellm.hook``, in front of a real ``vllm serve`` of the CPU build with
the tenantkv connector, started as the hosted-stack test starts it (docs/gateway.md's recipe).

What it shows, each refusal with its positive control:

* a team's repeated prompt (completions, streamed or not; chat completions) hits vLLM's
  cache (the hook's salt), and after vLLM's cache is emptied it hits tenantkv (only the
  connector, reading the hook's signed assertion, can have served it), with the uncached
  run's text;
* another team misses in both tiers, while the owner's copy is there;
* a client's ``cache_salt`` and ``kv_transfer_params`` never arrive: sent through LiteLLM they
  miss; sent straight to vLLM the same fields do reach the owner's blocks;
* a key of an unknown team, or of no team, is 403 and nothing reaches vLLM (its prompt-token
  counter does not move), while a team key's request does move it;
* what vLLM answers with ``kv_transfer_params`` reaches the client without it.

The index is SQLite, given in the configuration file (the hook reads tenants only; the
hosted-stack test runs the gateway on PostgreSQL too), to keep the engine tests' time.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen
from typing import Any

import httpx
import openai
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

import tenantkv
from tenantkv import TenantKV
from tenantkv.conformance.probe import empty_prefix_cache
from tenantkv.gateway import GatewayIdentity
from tenantkv.gateway.keyed import cache_salt
from tenantkv.tenant_assertion import ASSERTION_PARAM, AssertionSigner, public_key_pem
from tests.doc_recipes import toml_text
from tests.ports import free_port
from tests_engines.conftest import BLOCK, write_tiny_llama
from tests_engines.hosted import MODEL, REPO, serve_args, stop, wait_until_healthy
from tests_engines.litellm_proxy import PYTHON, TeamKey, litellm_proxy
from tests_engines.test_hosted_stack import chat_cached
from tests_engines.tiny_tokenizer import write_tiny_tokenizer

pytestmark = pytest.mark.skipif(
    not PYTHON.exists(), reason="no .venv-litellm: run scripts/setup_litellm.sh"
)

AUDIENCE = "litellm-e2e"
SECRET = b"l" * 32
MAX_TOKENS = 4
KEYS = {
    "sk-acme": TeamKey("acme", user_id="alice"),
    "sk-globex": TeamKey("globex", key_alias="globex-app"),
    "sk-stranger": TeamKey("no-such-tenant", user_id="mallory"),
    "sk-teamless": TeamKey(None, user_id="mallory"),
}


@dataclass
class Served:
    litellm: str  # LiteLLM proxy base URL
    vllm: str  # vllm serve base URL (the test's back door)
    kv: TenantKV
    signer: AssertionSigner
    #: tests_engines/litellm_unit_checks.py in .venv-litellm, started with the stack so that its
    #: LiteLLM import overlaps vllm serve's start
    unit_checks: Popen[str]


def served_config(base: Path) -> Path:
    """One file for the cache, the connector and the hook (its ``[gateway]`` table)."""
    root = base / "cache"
    signing = Ed25519PrivateKey.generate()
    keys = {
        "gateway-key.pem": signing.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()),
        "gateway.pub.pem": public_key_pem(signing.public_key()),
        "secret": SECRET,
    }
    for name, data in keys.items():
        (base / name).write_bytes(data)
    private, public, secret = (base / name for name in keys)
    config_file = base / "tenantkv.toml"
    cache = {"root": str(root), "database_url": f"sqlite:///{root}/index.db", "durable": False}
    vllm = {"gateway_public_keys": [str(public)], "audience": AUDIENCE}
    hook = {"audience": AUDIENCE, "secret_file": str(secret), "signing_key_file": str(private)}
    config_file.write_text(
        toml_text({"cache": cache, "vllm": vllm | {"require_incarnation": True}, "gateway": hook}),
        encoding="utf-8",
    )
    return config_file


@contextlib.contextmanager
def vllm_process(model: Path, config_file: Path, port: int, log: Path) -> Iterator[Popen[bytes]]:
    """``vllm serve`` as docs/gateway.md runs it, with the tenantkv connector reading
    ``config_file``, started (not yet waited for: the LiteLLM proxy starts meanwhile). The
    hosted-stack test starts one the same way; once that one is a shared session fixture, pass
    its URL to :func:`litellm_proxy` instead."""
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    }
    command = [sys.executable, "-m", "tests_engines.vllm_serve"]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, *serve_args(model, port, config_file)], cwd=REPO, env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        yield process
    finally:
        stop(process)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("litellm")
    model = write_tiny_tokenizer(write_tiny_llama(base / "tiny-llama"))
    config_file = served_config(base)
    cache = tenantkv.config.CacheConfig.from_env(config_file=config_file, environ={})
    signer = AssertionSigner((base / "gateway-key.pem").read_bytes())
    unit_checks = subprocess.Popen(
        [str(PYTHON), "-m", "tests_engines.litellm_unit_checks"],
        cwd=REPO,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with tenantkv.open(cache) as kv:
            kv.create_tenant("acme")
            kv.create_tenant("globex")
            port = free_port()
            vllm_url, log = f"http://127.0.0.1:{port}", base / "vllm-serve.log"
            with (
                vllm_process(model, config_file, port, log) as process,
                litellm_proxy(
                    vllm_url,
                    model=MODEL,
                    tenantkv_config=config_file,
                    keys=KEYS,
                    workdir=base / "litellm",
                ) as proxy_url,
            ):
                wait_until_healthy(process, vllm_url, log)
                yield Served(proxy_url, vllm_url, kv, signer, unit_checks)
    finally:
        if unit_checks.poll() is None:
            unit_checks.kill()
            unit_checks.wait(10)


def prompt(tag: str) -> str:
    """Three full blocks and a partial one of a prompt of its own (the tag first)."""
    return f"[{tag}] " + "You are a helpful assistant. Summarise the attached report. " * 3


@dataclass
class Reply:
    text: str
    prompt_tokens: int
    cached: int


def ask(base_url: str, key: str, text: str, *, stream: bool = False, **body: Any) -> Reply:
    """A greedy completion through the official client; ``body``: extra fields of the JSON."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=60)
    common: dict[str, Any] = {
        "model": MODEL,
        "prompt": text,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": body,
    }
    if stream:
        pieces, usage = [], None
        chunks = client.completions.create(
            **common, stream=True, stream_options={"include_usage": True}
        )
        for chunk in chunks:
            pieces += [choice.text or "" for choice in chunk.choices]
            usage = chunk.usage if chunk.usage and chunk.usage.prompt_tokens else usage
        words = "".join(pieces)
    else:
        done = client.completions.create(**common)
        words, usage = done.choices[0].text, done.usage
    assert usage is not None and usage.prompt_tokens_details is not None, "no usage details"
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return Reply(words, usage.prompt_tokens, cached)


def full_blocks(reply: Reply) -> int:
    return (reply.prompt_tokens - 1) // BLOCK * BLOCK


def reset_vllm_prefix_cache(served: Served) -> None:
    """Empty vLLM's own prefix cache (not the connector's): a later hit is tenantkv's.
    Asks again while vLLM still holds blocks (the connector's saves in flight)."""
    with httpx.Client(timeout=30) as client:
        empty_prefix_cache(client, served.vllm)


def prompt_tokens_seen(served: Served) -> float:
    """vLLM's own count of the prompt tokens it has been sent (its Prometheus counter)."""
    text = httpx.get(served.vllm + "/metrics", timeout=10).text
    found = re.findall(r"^vllm:prompt_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE)
    assert found, "vllm serve exposes no vllm:prompt_tokens_total"
    return sum(float(v) for v in found)


STREAMING = pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])


@STREAMING
def test_a_teams_repeated_prompt_hits_vllms_cache_then_tenantkv(
    served: Served, stream: bool
) -> None:
    text = prompt(f"owner-{stream}")
    first = ask(served.litellm, "sk-acme", text, stream=stream)
    assert first.cached == 0
    again = ask(served.litellm, "sk-acme", text, stream=stream)  # vLLM's cache: the hook's salt
    assert again.cached == full_blocks(first) > 0
    reset_vllm_prefix_cache(served)
    loaded = ask(served.litellm, "sk-acme", text, stream=stream)  # only the connector now
    assert loaded.cached == full_blocks(first)
    assert loaded.text == first.text


def test_chat_completions_hit_for_the_team_and_miss_for_another(served: Served) -> None:
    """LiteLLM's chat path (its ModelResponse and stream chunks), json then streamed."""
    text = prompt("chat")
    assert chat_cached(served.litellm, "sk-acme", text, stream=False) == 0
    assert chat_cached(served.litellm, "sk-acme", text, stream=True) > 0  # control
    assert chat_cached(served.litellm, "sk-globex", text, stream=True) == 0


def test_another_team_misses_in_both_tiers(served: Served) -> None:
    warm = prompt("other-team-warm")
    first = ask(served.litellm, "sk-acme", warm)
    assert ask(served.litellm, "sk-acme", warm).cached == full_blocks(first)  # control
    assert ask(served.litellm, "sk-globex", warm).cached == 0  # another salt in vLLM's cache

    stored = prompt("other-team-stored")  # a prompt globex has never sent
    owner = ask(served.litellm, "sk-acme", stored)
    reset_vllm_prefix_cache(served)  # from here only tenantkv could serve a hit
    assert ask(served.litellm, "sk-globex", stored, stream=True).cached == 0
    assert ask(served.litellm, "sk-acme", stored).cached == full_blocks(owner)  # control


@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "in-extra_body"])
def test_a_client_cache_salt_is_stripped(served: Served, nested: bool) -> None:
    text = prompt(f"salt-{nested}")  # a prompt of its own: globex then stores its own copy
    first = ask(served.litellm, "sk-acme", text)
    incarnation = served.kv.tenant_incarnation("acme")
    assert incarnation is not None
    identity = GatewayIdentity("any", "acme", "alice", incarnation.incarnation)
    acme_salt = cache_salt(SECRET, identity)
    field: dict[str, Any] = {"cache_salt": acme_salt}
    attack = {"extra_body": field} if nested else field  # LiteLLM merges extra_body upstream

    assert ask(served.litellm, "sk-globex", text, **attack).cached == 0
    # positive control: straight to vLLM, the salt does reach acme's blocks (and shows the
    # hook salted acme's requests with exactly this value)
    assert ask(served.vllm, "unused", text, **field).cached == full_blocks(first)


def test_client_kv_transfer_params_are_stripped(served: Served) -> None:
    text = prompt("params")
    stored = ask(served.litellm, "sk-acme", text)
    incarnation = served.kv.tenant_incarnation("acme")
    assert incarnation is not None
    replayed = served.signer.sign(
        "acme", scope="alice", audience=AUDIENCE, ttl=60, incarnation=incarnation.incarnation
    )
    params = {ASSERTION_PARAM: replayed}
    reset_vllm_prefix_cache(served)  # only tenantkv could serve a hit now
    assert ask(served.litellm, "sk-globex", text, kv_transfer_params=params).cached == 0
    # positive control: straight to vLLM (under a salt of no identity), the captured
    # assertion loads acme's KV from tenantkv
    direct = ask(served.vllm, "unused", text, cache_salt="probe", kv_transfer_params=params)
    assert direct.cached == full_blocks(stored)


@pytest.mark.parametrize("key", ["sk-stranger", "sk-teamless"])
def test_a_key_of_no_tenant_team_is_refused_and_nothing_reaches_vllm(
    served: Served, key: str
) -> None:
    before = prompt_tokens_seen(served)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        ask(served.litellm, key, prompt(f"refused-{key}"))
    assert refused.value.status_code == 403
    assert "tenantkv" in str(refused.value)
    assert prompt_tokens_seen(served) == before
    ask(served.litellm, "sk-globex", prompt(f"refused-{key}"))  # control: a team key's does
    assert prompt_tokens_seen(served) > before


def test_answers_lose_kv_transfer_params(served: Served) -> None:
    body = {"model": MODEL, "prompt": prompt("answer"), "max_tokens": 2, "temperature": 0}
    direct = httpx.post(served.vllm + "/v1/completions", json=body, timeout=60)
    assert direct.status_code == 200 and "kv_transfer_params" in direct.json()  # control
    through = httpx.post(
        served.litellm + "/v1/completions",
        json=body,
        headers={"Authorization": "Bearer sk-acme"},
        timeout=60,
    )
    assert through.status_code == 200, through.text
    assert "kv_transfer_params" not in through.text and "tenantkv" not in through.text
    assert through.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]


def test_the_hooks_unit_checks_pass_on_litellms_own_types(served: Served) -> None:
    """tests_engines/litellm_unit_checks.py in .venv-litellm (LiteLLM's types, no proxy)."""
    output, _ = served.unit_checks.communicate(timeout=300)
    assert served.unit_checks.returncode == 0, output
    summary = re.search(r"^(\d+) passed, 0 failed$", output, re.MULTILINE)
    assert summary is not None and int(summary.group(1)) >= 5, output
