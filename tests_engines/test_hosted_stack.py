"""The hosted stack end to end on CPU: the official ``openai`` client calls ``tenantkv gateway``
(built from the deployment's configuration file by ``build_gateway``, with the cache's real
inference keys, served by uvicorn on 127.0.0.1) in front of a real ``vllm serve`` of the CPU
build (a child process on 127.0.0.1, started with the documented recipe of docs/gateway.md:
the tenantkv connector by ``--kv-transfer-config`` naming the same file; the session's one
stack, tests_engines/hosted.py). The model is a tiny
random Llama and a byte-level tokenizer written at test time; nothing is downloaded.

vLLM's own prefix cache is ON, as the recipe says to run it: then the gateway's ``cache_salt``
is what keeps one tenant off another's blocks in vLLM's cache, and a client-chosen salt is a
real attack. Where a test must show that a hit came from tenantkv and not from vLLM's cache, it
empties vLLM's cache first through vLLM's own ``POST /reset_prefix_cache`` (dev mode, on the
backend directly, which only the test reaches); after that a cached token can only have been
loaded by the connector. ``usage.prompt_tokens_details.cached_tokens`` (the recipe's
``--enable-prompt-tokens-details``) is how the client sees a hit, streamed or not.

Each refusal has its positive control: the owner's repeated prompt hits (with the greedy tokens
and log-probabilities of the uncached run), and each attack the gateway stops is shown to work
when its body is sent straight to vLLM (a client-chosen salt reads the owner's blocks from vLLM's
cache; a replayed assertion loads the owner's KV from tenantkv), so a miss through the gateway
is the gateway's doing. Each test uses prompts of its own, so none depends on another's order.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tenantkv.conformance.probe import empty_prefix_cache
from tenantkv.gateway import GatewayIdentity
from tenantkv.gateway.keyed import cache_salt
from tenantkv.integrations.engine_identity import ASSERTION_PARAM
from tenantkv.tenant_assertion import AssertionSigner
from tests_engines.hosted import AUDIENCE, BLOCK, MODEL, SECRET, Stack

MAX_TOKENS = 6


@pytest.fixture
def stack(hosted_stack: Stack) -> Stack:
    """The session's one hosted stack (tests_engines/hosted.py)."""
    return hosted_stack


@dataclass
class Answer:
    """One completion as the client saw it."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    prompt_tokens: int
    cached: int


def prompt(tag: str) -> str:
    """A prompt of its own per test (the tag first: no two tests share a first block), of
    121 tokens or so: three full blocks and a partial one."""
    return f"[{tag}] " + "You are a helpful assistant. Summarise the attached report. " * 3


def complete(base_url: str, key: str, text: str, *, stream: bool, **body: Any) -> Answer:
    """A greedy completion through the official client; ``body``: extra fields of the JSON."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=60)
    extra = {"return_token_ids": True, **body}
    common: dict[str, Any] = {
        "model": MODEL,
        "prompt": text,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 1,
        "extra_body": extra,
    }
    if not stream:
        done = client.completions.create(**common)
        (choice,) = done.choices
        usage = done.usage
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        pieces, token_ids = [choice.text], list(choice.token_ids)  # type: ignore[attr-defined]
        logprobs = list(choice.logprobs.token_logprobs)
    else:
        pieces, token_ids, logprobs, usage = [], [], [], None
        chunks = client.completions.create(
            **common, stream=True, stream_options={"include_usage": True}
        )
        for chunk in chunks:
            for choice in chunk.choices:
                pieces.append(choice.text)
                token_ids.extend(choice.token_ids or [])  # type: ignore[attr-defined]
                if choice.logprobs is not None and choice.logprobs.token_logprobs:
                    logprobs.extend(choice.logprobs.token_logprobs)
            if chunk.usage is not None:
                usage = chunk.usage
    assert usage is not None and usage.prompt_tokens_details is not None, "no usage details"
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    assert len(token_ids) == len(logprobs) == MAX_TOKENS
    return Answer("".join(pieces), token_ids, logprobs, usage.prompt_tokens, cached)


def full_blocks(answer: Answer) -> int:
    """The tokens a cache can serve of this prompt: its full blocks before the last token."""
    return (answer.prompt_tokens - 1) // BLOCK * BLOCK


def same_output(answer: Answer, reference: Answer) -> bool:
    """Greedy decoding from a loaded prefix gives the uncached run's tokens and, to float32
    noise, its log-probabilities (a wrong or shifted KV would change them)."""
    pairs = zip(answer.logprobs, reference.logprobs, strict=True)
    return answer.token_ids == reference.token_ids and all(
        math.isclose(a, b, abs_tol=1e-3) for a, b in pairs
    )


def reset_vllm_prefix_cache(stack: Stack) -> None:
    """Empty vLLM's own prefix cache (not the connector's): a later hit is tenantkv's.
    Asks again while vLLM still holds blocks (the connector's saves in flight)."""
    with httpx.Client(timeout=30) as client:
        empty_prefix_cache(client, stack.vllm)


def assertion_for(stack: Stack, tenant: str, **overrides: Any) -> str:
    """An assertion as the gateway signs for ``tenant``'s requests (what a captured one is)."""
    incarnation = stack.kv.tenant_incarnation(tenant)
    assert incarnation is not None
    claims: dict[str, Any] = {"audience": AUDIENCE, "ttl": 60, **overrides}
    return stack.signer.sign(tenant, incarnation=incarnation.incarnation, **claims)


STREAMING = pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])


@STREAMING
def test_owner_repeated_prompt_is_served_from_tenantkv_with_the_uncached_tokens(
    stack: Stack, stream: bool
) -> None:
    text, key = prompt(f"owner-{stream}"), stack.keys["acme"]
    first = complete(stack.gateway, key, text, stream=stream)
    assert first.cached == 0
    again = complete(stack.gateway, key, text, stream=stream)  # vLLM's cache, the salt's
    assert again.cached == full_blocks(first) > 0
    assert same_output(again, first)

    reset_vllm_prefix_cache(stack)
    from_tenantkv = complete(stack.gateway, key, text, stream=stream)
    assert from_tenantkv.cached == full_blocks(first)  # only the connector can have served it
    assert same_output(from_tenantkv, first)
    # control of the comparison: another prompt's output is told apart
    other = complete(stack.gateway, key, prompt(f"owner-other-{stream}"), stream=stream)
    assert not same_output(other, first)


@STREAMING
def test_another_tenant_misses_in_vllms_cache_and_in_tenantkv(stack: Stack, stream: bool) -> None:
    acme, globex = stack.keys["acme"], stack.keys["globex"]
    warm = prompt(f"other-warm-{stream}")
    first = complete(stack.gateway, acme, warm, stream=stream)
    assert complete(stack.gateway, acme, warm, stream=stream).cached == full_blocks(first)
    # acme's blocks are in vLLM's cache now: globex's salt is another partition of it
    assert complete(stack.gateway, globex, warm, stream=stream).cached == 0

    stored = prompt(f"other-stored-{stream}")
    complete(stack.gateway, acme, stored, stream=stream)
    reset_vllm_prefix_cache(stack)  # from here, only tenantkv could serve a hit
    assert complete(stack.gateway, globex, stored, stream=stream).cached == 0
    control = complete(stack.gateway, acme, stored, stream=stream)
    assert control.cached == full_blocks(control) > 0  # the owner's copy is there


@STREAMING
def test_a_client_chosen_cache_salt_is_stripped(stack: Stack, stream: bool) -> None:
    acme, globex = stack.keys["acme"], stack.keys["globex"]
    text = prompt(f"salt-{stream}")
    first = complete(stack.gateway, acme, text, stream=stream)
    assert complete(stack.gateway, acme, text, stream=stream).cached == full_blocks(first)
    info = next(k for k in stack.kv.inference_keys.list("acme") if k.name == "e2e")
    incarnation = stack.kv.tenant_incarnation("acme")
    assert incarnation is not None
    acme_salt = cache_salt(SECRET, GatewayIdentity(info.id, "acme", None, incarnation.incarnation))

    stolen = complete(stack.gateway, globex, text, stream=stream, cache_salt=acme_salt)
    assert stolen.cached == 0
    # positive control: the same salt sent straight to vLLM reads acme's blocks from its cache
    direct = complete(stack.vllm, "unused", text, stream=stream, cache_salt=acme_salt)
    assert direct.cached == full_blocks(first)


@pytest.mark.parametrize("attack", ["replayed", "forged", "other-audience"], ids=str)
@STREAMING
def test_client_kv_transfer_params_are_stripped(stack: Stack, stream: bool, attack: str) -> None:
    acme, globex = stack.keys["acme"], stack.keys["globex"]
    if attack == "forged":  # acme's claims under a key that is not the gateway's
        incarnation = stack.kv.tenant_incarnation("acme")
        assert incarnation is not None
        rogue = AssertionSigner(Ed25519PrivateKey.generate())
        token = rogue.sign("acme", audience=AUDIENCE, incarnation=incarnation.incarnation)
    elif attack == "other-audience":  # the gateway's key, signed for another deployment
        token = assertion_for(stack, "acme", audience="another-deployment")
    else:  # genuine and live, as if captured from acme's traffic
        token = assertion_for(stack, "acme")
    params = {ASSERTION_PARAM: token}

    text = prompt(f"params-{attack}-{stream}")
    stored = complete(stack.gateway, acme, text, stream=stream)
    reset_vllm_prefix_cache(stack)  # only tenantkv could serve a hit now
    stolen = complete(stack.gateway, globex, text, stream=stream, kv_transfer_params=params)
    assert stolen.cached == 0

    # The same field sent straight to vLLM, under a salt of no identity (so vLLM's own cache
    # cannot serve it): the replayed assertion loads acme's KV from tenantkv, so through the
    # gateway it was the stripping that stopped it. The forged and other-audience ones the
    # connector refuses by itself too (a second layer, not the gateway's doing).
    salt = f"probe-{attack}-{stream}"
    direct = complete(
        stack.vllm, "unused", text, stream=stream, cache_salt=salt, kv_transfer_params=params
    )
    assert direct.cached == (full_blocks(stored) if attack == "replayed" else 0)


@STREAMING
def test_a_revoked_key_is_401_within_a_second(stack: Stack, stream: bool) -> None:
    info, key = stack.kv.inference_keys.create("globex", f"revoked-{stream}")
    text = prompt(f"revoked-{stream}")
    assert complete(stack.gateway, key, text, stream=stream).cached == 0  # control: it works
    assert stack.kv.inference_keys.revoke("globex", info.id)
    revoked_at = time.monotonic()
    with pytest.raises(openai.AuthenticationError) as refused:
        complete(stack.gateway, key, text, stream=stream)
    assert time.monotonic() - revoked_at < 1.0
    assert refused.value.status_code == 401
    # control: the tenant's other key still works (complete() checks the whole answer)
    assert len(complete(stack.gateway, stack.keys["globex"], text, stream=stream).token_ids)


@STREAMING
def test_a_deleted_tenants_keys_are_401_and_a_new_tenant_of_the_name_misses(
    stack: Stack, stream: bool
) -> None:
    tenant = f"initech-{'stream' if stream else 'json'}"
    stack.kv.create_tenant(tenant)
    _, key = stack.kv.inference_keys.create(tenant, "app")
    text = prompt(f"deleted-{stream}")
    first = complete(stack.gateway, key, text, stream=stream)
    assert complete(stack.gateway, key, text, stream=stream).cached == full_blocks(first)

    stack.kv.delete_tenant(tenant)  # its keys die with it
    with pytest.raises(openai.AuthenticationError) as refused:
        complete(stack.gateway, key, text, stream=stream)
    assert refused.value.status_code == 401

    stack.kv.create_tenant(tenant)  # the next tenant of the name revives nothing
    _, fresh = stack.kv.inference_keys.create(tenant, "app")
    assert complete(stack.gateway, fresh, text, stream=stream).cached == 0
    reset_vllm_prefix_cache(stack)
    control = complete(stack.gateway, fresh, text, stream=stream)  # its own copy, in tenantkv
    assert control.cached == full_blocks(first)


def chat_cached(base_url: str, key: str, text: str, *, stream: bool) -> int:
    """The cached prompt tokens of a greedy chat completion (the tokenizer's chat template)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=60)
    common: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if stream:
        chunks = client.chat.completions.create(
            **common, stream=True, stream_options={"include_usage": True}
        )
        usage = None
        for chunk in chunks:
            usage = chunk.usage or usage
    else:
        usage = client.chat.completions.create(**common).usage
    assert usage is not None and usage.prompt_tokens_details is not None, "no usage details"
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return cached


@STREAMING
def test_chat_completions_hit_for_the_owner_and_miss_for_another_tenant(
    stack: Stack, stream: bool
) -> None:
    acme, globex = stack.keys["acme"], stack.keys["globex"]
    text = prompt(f"chat-{stream}")
    assert chat_cached(stack.gateway, acme, text, stream=stream) == 0
    assert chat_cached(stack.gateway, acme, text, stream=stream) > 0  # control
    assert chat_cached(stack.gateway, globex, text, stream=stream) == 0
    reset_vllm_prefix_cache(stack)
    assert chat_cached(stack.gateway, acme, text, stream=stream) > 0  # from tenantkv
    assert chat_cached(stack.gateway, globex, text, stream=stream) > 0  # its own copy now
