"""tenantkv gateway against a real recording backend on loopback: identity fields stripped,
salt and assertion set by the gateway, affinity and failover, every error case, streaming and
cancel on disconnect. Each refusal test has its positive control."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tenantkv.errors import InvalidRequestError, TenantAssertionError
from tenantkv.gateway import GatewayIdentity, GatewaySettings, create_gateway_app
from tenantkv.gateway.headers import forwarded_headers
from tenantkv.gateway.keyed import affinity_digest, cache_salt
from tenantkv.gateway.scrub import identity_bearing
from tenantkv.integrations.engine_identity import ASSERTION_PARAM
from tenantkv.tenant_assertion import WRONG_AUDIENCE, AssertionSigner, AssertionVerifier

from .gateway_stack import DictAuthenticator, Recording, dead_url, recording_backend, serving

AUD = "deployment-1"
SECRET = b"g" * 32
INC_A, INC_B = "a" * 32, "b" * 32
IDS = {
    "key-a": GatewayIdentity("ka", "acme", "alice", INC_A),
    "key-a2": GatewayIdentity("ka2", "acme", "bob", INC_A),
    "key-b": GatewayIdentity("kb", "globex", "alice", INC_B),
}
KEY = Ed25519PrivateKey.generate()


def auth(key: str = "key-a") -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def markers_in(value: Any) -> list[str]:
    """Every identity-bearing key anywhere in ``value``."""
    found: list[str] = []
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found += [k for k in node if identity_bearing(k)]
            stack += list(node.values())
        elif isinstance(node, list):
            stack += node
    return found


class Stack:
    def __init__(self, url: str, backends: list[Recording]) -> None:
        self.url = url
        self.backends = backends
        self.client = httpx.Client(base_url=url, timeout=10)

    def received(self) -> list[dict[str, Any]]:
        return [r for b in self.backends for r in b.requests]

    def reset(self) -> None:
        for b in self.backends:
            b.requests.clear()
            b.cancelled.clear()
            b.completed.clear()


@contextmanager
def stack(
    n_backends: int = 2, *, extra: list[str] | None = None, **settings: Any
) -> Iterator[Stack]:
    recs = [Recording(f"b{i}") for i in range(n_backends)]
    with serving(recording_backend(recs[0])) as u0:
        urls = [u0]
        if n_backends > 1:
            with serving(recording_backend(recs[1])) as u1:
                urls.append(u1)
                with _gateway(urls + (extra or []), recs, settings) as s:
                    yield s
                return
        with _gateway(urls + (extra or []), recs, settings) as s:
            yield s


@contextmanager
def _gateway(urls: list[str], recs: list[Recording], settings: dict[str, Any]) -> Iterator[Stack]:
    app = create_gateway_app(
        DictAuthenticator(IDS),
        AssertionSigner(KEY),
        secret=SECRET,
        backends=urls,
        settings=GatewaySettings(audience=AUD, **settings),
    )
    with serving(app) as url:
        s = Stack(url, recs)
        s.app = app  # type: ignore[attr-defined]
        try:
            yield s
        finally:
            s.client.close()


@pytest.fixture(scope="module")
def gw() -> Iterator[Stack]:
    with stack() as s:
        yield s


@pytest.fixture(autouse=False)
def fresh(gw: Stack) -> Stack:
    gw.reset()
    return gw


def completion(s: Stack, key: str = "key-a", **body: Any) -> httpx.Response:
    return s.client.post(
        "/v1/completions", json={"model": "m", "prompt": "hi", **body}, headers=auth(key)
    )


# ------------------------------------------------------------------------- authentication


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": "Basic key-a"},
        {"Authorization": "key-a"},
    ],
)
def test_unknown_or_missing_key_is_401_and_nothing_goes_upstream(
    fresh: Stack, headers: dict[str, str]
) -> None:
    answer = fresh.client.post(
        "/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers
    )
    assert answer.status_code == 401
    assert answer.json()["error"]["type"] == "invalid_api_key"
    assert fresh.received() == []
    # positive control: the known key goes through
    assert completion(fresh).status_code == 200
    assert len(fresh.received()) == 1


def test_a_revoked_key_is_401_at_once(fresh: Stack) -> None:
    authenticator = fresh.app.state.gateway.authenticator  # type: ignore[attr-defined]
    assert completion(fresh, "key-b").status_code == 200  # control: valid before
    identity = authenticator.keys.pop("key-b")
    try:
        assert completion(fresh, "key-b").status_code == 401
        assert len(fresh.received()) == 1
    finally:
        authenticator.keys["key-b"] = identity


# ------------------------------------------------------------------ what goes upstream


ATTACK = {
    "cache_salt": "victim-salt",
    "kv_transfer_params": {ASSERTION_PARAM: "tkva1.forged.sig", "other": 1},
    "vllm_xargs": {"kv_transfer_params": {ASSERTION_PARAM: "x"}},
    "extra_body": {"cache_salt": "s2", "kv_transfer_params": {"a": 1}, "keep": "kept"},
    "extra_args": {"kv_transfer_params": {"a": 1}},
    "Cache-Salt": "s3",
    "cacheSalt": "s4",
    "tenantkv_assertion": "x",
    "metadata": {"deep": [{"KV_TRANSFER_PARAMS": 1, "fine": 2}]},
}


def test_client_identity_fields_never_arrive_and_gateway_sets_its_own(fresh: Stack) -> None:
    answer = fresh.client.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "cache_salt kv_transfer_params"}],
            "max_tokens": 7,
            **ATTACK,
        },
        headers=auth(),
    )
    assert answer.status_code == 200
    (got,) = fresh.received()
    body = got["body"]
    # positive control: everything legitimate arrived unchanged
    assert body["messages"] == [{"role": "user", "content": "cache_salt kv_transfer_params"}]
    assert body["max_tokens"] == 7 and body["extra_body"] == {"keep": "kept"}
    assert body["metadata"] == {"deep": [{"fine": 2}]}
    # only the gateway's salt and assertion, nothing of the client's
    assert body["cache_salt"] == cache_salt(SECRET, IDS["key-a"]) != "victim-salt"
    assert list(body["kv_transfer_params"]) == [ASSERTION_PARAM]
    rest = {k: v for k, v in body.items() if k not in ("cache_salt", "kv_transfer_params")}
    assert markers_in(rest) == []


def test_salts_partition_by_identity_and_are_stable(fresh: Stack) -> None:
    for i, key in enumerate(("key-a", "key-a", "key-a2", "key-b")):
        assert completion(fresh, key, prompt=str(i)).status_code == 200
    by_prompt = {r["body"]["prompt"]: r["body"]["cache_salt"] for r in fresh.received()}
    salts = [by_prompt[str(i)] for i in range(4)]
    assert salts[0] == salts[1]  # same identity, same salt
    assert len({salts[0], salts[2], salts[3]}) == 3  # other scope, other tenant
    reborn = GatewayIdentity("k", "acme", "alice", "c" * 32)  # same name, new incarnation
    assert cache_salt(SECRET, reborn) != salts[0]
    assert cache_salt(b"h" * 32, IDS["key-a"]) != salts[0]  # keyed


def test_assertion_verifies_for_the_right_identity_and_audience(fresh: Stack) -> None:
    assert completion(fresh, "key-a2").status_code == 200
    assertion = fresh.received()[0]["body"]["kv_transfer_params"][ASSERTION_PARAM]
    verifier = AssertionVerifier([KEY.public_key()], audience=AUD, require_incarnation=True)
    claims = verifier.verify(assertion)
    assert (claims.tenant, claims.scope, claims.incarnation, claims.audience) == (
        "acme",
        "bob",
        INC_A,
        AUD,
    )
    assert claims.expires_at - claims.issued_at == 60
    with pytest.raises(TenantAssertionError) as refused:
        AssertionVerifier([KEY.public_key()], audience="other").verify(assertion)
    assert refused.value.reason == WRONG_AUDIENCE


def test_only_allow_listed_clean_headers_go_upstream(fresh: Stack) -> None:
    answer = fresh.client.post(
        "/v1/completions",
        json={"model": "m", "prompt": "p"},
        headers={
            **auth(),
            "X-Request-Id": "r-1",
            "Cookie": "c=1",
            "X-Forwarded-For": "1.2.3.4",
            "User-Agent": "ua",
        },
    )
    assert answer.status_code == 200
    headers = fresh.received()[0]["headers"]
    assert headers["x-request-id"] == "r-1" and headers["user-agent"] == "ua"  # control
    assert not {"authorization", "cookie", "x-forwarded-for"} & set(headers)


def test_control_characters_in_header_values_are_not_forwarded() -> None:
    raw = [(b"x-request-id", b"a\r\nx-evil: 1"), (b"accept", b"a\x00b"), (b"user-agent", b"fine")]
    assert forwarded_headers(raw) == {"user-agent": "fine", "content-type": "application/json"}


def test_cr_lf_in_a_header_reaches_nothing_upstream(fresh: Stack) -> None:
    host, port = fresh.url.removeprefix("http://").split(":")
    body = b'{"model":"m","prompt":"p"}'
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\n"
        b"X-Request-Id: a\rX-Evil: 1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request)
        status = sock.recv(4096).split(b"\r\n", 1)[0]
    assert b" 400 " in status
    assert fresh.received() == []


# -------------------------------------------------------------------- what comes back


def test_responses_lose_tenantkv_fields_and_keep_usage(fresh: Stack) -> None:
    answer = completion(fresh)
    assert answer.status_code == 200
    data = answer.json()
    assert markers_in(data) == []
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 2  # usage passes
    assert data["choices"][0]["text"] == "hello"


def stream_events(answer: httpx.Response) -> list[Any]:
    return [
        json.loads(line[6:])
        for line in answer.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_streamed_chunks_pass_cleaned_as_they_arrive(fresh: Stack) -> None:
    start = time.monotonic()
    with fresh.client.stream(
        "POST",
        "/v1/completions",
        headers=auth(),
        json={"model": "slow", "prompt": "p", "stream": True, "tag": "full"},
    ) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = answer.iter_lines()
        first = next(line for line in lines if line)
        first_at = time.monotonic() - start
        rest = "\n".join(lines)
    total = time.monotonic() - start
    assert first_at < 1.0 < total  # the first chunk came long before the 4 s stream ended
    events = [json.loads(first[6:])] + [
        json.loads(line[6:])
        for line in rest.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert len(events) == 41 and "data: [DONE]" in rest
    assert all(markers_in(e) == [] for e in events)
    assert [e["choices"][0]["text"] for e in events[:40]] == [f"t{i}" for i in range(40)]
    assert events[-1]["usage"]["total_tokens"] == 8
    assert fresh.backends[0].completed + fresh.backends[1].completed == ["full"]  # control


def test_a_client_that_disconnects_cancels_the_upstream_stream(fresh: Stack) -> None:
    with fresh.client.stream(
        "POST",
        "/v1/completions",
        headers=auth(),
        json={"model": "slow", "prompt": "p", "stream": True, "tag": "gone"},
    ) as answer:
        assert answer.status_code == 200
        next(answer.iter_lines())
    deadline = time.monotonic() + 3
    cancelled: list[str] = []
    while time.monotonic() < deadline and not cancelled:
        cancelled = fresh.backends[0].cancelled + fresh.backends[1].cancelled
        time.sleep(0.05)
    assert cancelled == ["gone"]
    assert fresh.backends[0].completed + fresh.backends[1].completed == []
    # the key's slot came back: the same key is served again
    assert completion(fresh).status_code == 200


# ------------------------------------------------------------------ routing


def test_affinity_keeps_a_prefix_on_one_backend_and_spreads_prefixes(fresh: Stack) -> None:
    where: dict[int, set[str]] = {}
    for prefix in range(12):
        for suffix in range(3):
            prompt = f"system prompt {prefix} " + "x" * 600 + f" question {suffix}"
            assert completion(fresh, prompt=prompt).status_code == 200
            where.setdefault(prefix, set()).add(
                "b0"
                if fresh.backends[0].requests
                and fresh.backends[0].requests[-1]["body"]["prompt"] == prompt
                else "b1"
            )
    assert all(len(names) == 1 for names in where.values())  # each prefix stayed on one
    assert {n for names in where.values() for n in names} == {"b0", "b1"}  # both were used


def test_a_failed_backend_is_skipped_for_the_next_in_rank() -> None:
    dead = dead_url()
    with stack(1, extra=[dead], backend_cooldown=0.0) as s:
        router = s.app.state.gateway.router  # type: ignore[attr-defined]
        dead_first = 0
        for prefix in range(16):
            body = {"model": "m", "prompt": f"prefix {prefix}"}
            digest = affinity_digest(SECRET, IDS["key-a"], body, chars=512, messages=2)
            dead_first += router.rank(digest)[0] == dead
            assert completion(s, prompt=body["prompt"]).status_code == 200
        assert dead_first > 0  # control: the dead backend was ranked first for some prefixes
        assert len(s.backends[0].requests) == 16


# -------------------------------------------------------------------- errors


def test_body_over_the_limit_is_413(fresh: Stack) -> None:
    big = completion(fresh, prompt="x" * (1024 * 1024 + 1))
    assert big.status_code == 413
    chunked = fresh.client.post(
        "/v1/completions",
        headers=auth(),
        content=iter([b'{"prompt":"' + b"x" * 700_000, b"x" * 700_000 + b'"}']),
    )
    assert chunked.status_code == 413
    assert fresh.received() == []
    assert completion(fresh, prompt="x" * 1000).status_code == 200  # control


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000])
def test_malformed_json_is_400(fresh: Stack, content: bytes) -> None:
    answer = fresh.client.post("/v1/completions", headers=auth(), content=content)
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert fresh.received() == []


def test_per_key_concurrency_is_bounded_with_429() -> None:
    with stack(1, max_concurrency_per_key=1) as s:
        with s.client.stream(
            "POST",
            "/v1/completions",
            headers=auth(),
            json={"model": "slow", "prompt": "p", "stream": True},
        ) as held:
            lines = held.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)
            assert completion(s).status_code == 429
            assert completion(s, "key-b").status_code == 200  # control: another key is served
        deadline = time.monotonic() + 3
        while completion(s).status_code == 429:  # the slot returns once the stream is gone
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_backend_that_hangs_is_504() -> None:
    with stack(1, upstream_timeout=0.5) as s:
        answer = completion(s, model="hang")
        assert answer.status_code == 504
        assert completion(s).status_code == 200  # control


def test_upstream_errors_are_502_without_their_text(fresh: Stack) -> None:
    answer = completion(fresh, model="fail")
    assert answer.status_code == 502
    assert "Traceback" not in answer.text and "secret" not in answer.text


def test_no_reachable_backend_is_502_and_readyz_fails() -> None:
    recs = [Recording("none")]
    with _gateway([dead_url(), dead_url()], recs, {}) as s:
        answer = completion(s)
        assert (
            answer.status_code == 502 and answer.json()["error"]["type"] == "upstream_unreachable"
        )
        assert s.client.get("/readyz").status_code == 503
        assert s.client.get("/healthz").status_code == 200


def test_readyz_needs_one_backend_answering(fresh: Stack) -> None:
    assert fresh.client.get("/readyz").status_code == 200
    fresh.backends[0].healthy = False
    try:
        assert fresh.client.get("/readyz").status_code == 200  # the other answers
        fresh.backends[1].healthy = False
        assert fresh.client.get("/readyz").status_code == 503
    finally:
        fresh.backends[0].healthy = fresh.backends[1].healthy = True


def test_an_unknown_model_passes_the_backends_4xx_cleaned(fresh: Stack) -> None:
    answer = completion(fresh, model="unknown")
    assert answer.status_code == 404
    assert "does not exist" in answer.json()["error"]["message"]
    assert markers_in(answer.json()) == []


# -------------------------------------------------------------------- settings and CLI


@pytest.mark.parametrize(
    "bad",
    [
        {"audience": ""},
        {"upstream_timeout": float("nan")},
        {"connect_timeout": 0},
        {"max_body_bytes": 0},
        {"max_concurrency_per_key": 0},
        {"assertion_lifetime": 7200},
        {"assertion_lifetime": float("inf")},
        {"max_concurrency_per_key": True},
    ],
)
def test_settings_are_validated(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError):
        GatewaySettings(**{"audience": AUD, **bad})
    GatewaySettings(audience=AUD)  # control


@pytest.mark.parametrize(
    "urls", [[], ["ftp://h"], ["http://u:p@h"], ["http://h?q=1"], ["http://h", "http://h/"]]
)
def test_backend_urls_are_validated(urls: list[str]) -> None:
    with pytest.raises(InvalidRequestError):
        create_gateway_app(
            DictAuthenticator(IDS),
            AssertionSigner(KEY),
            secret=SECRET,
            backends=urls,
            settings=GatewaySettings(audience=AUD),
        )


def test_cli_gateway_refuses_a_root_without_a_cache(index: Any, tmp_path: Any, capsys: Any) -> None:
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    from tenantkv.cli import main

    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    key = tmp_path / "key.pem"
    key.write_bytes(KEY.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    args = ["--backend", "http://127.0.0.1:1", "--audience", AUD]
    args += ["--secret-file", str(secret), "--signing-key-file", str(key)]
    rc = main(["gateway", str(tmp_path / "mistyped"), *args])
    assert rc == 2
    assert "no tenantkv cache" in capsys.readouterr().err
    assert not (tmp_path / "mistyped").exists()
