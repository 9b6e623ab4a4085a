"""Checks of tenantkv's LiteLLM hook on LiteLLM's own types (``UserAPIKeyAuth``, its response
classes), no proxy and no engine. They run in .venv-litellm, where LiteLLM is installed, as

    .venv-litellm/bin/python -m tests_engines.litellm_unit_checks

which prints ``N passed, 0 failed`` and exits non-zero on a failure;
tests_engines/test_litellm_hook.py runs it so (that venv has no pytest: LiteLLM's pins are the
point of it).
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from collections.abc import AsyncIterator, Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi import HTTPException
from litellm.proxy._types import UserAPIKeyAuth
from litellm.types.utils import ModelResponse, ModelResponseStream, TextCompletionResponse

from tenantkv.errors import CacheUnavailableError, InvalidRequestError
from tenantkv.gateway import GatewaySettings
from tenantkv.gateway.keyed import cache_salt
from tenantkv.integrations.litellm import TenantKVHook, litellm_identity, strip_answer
from tenantkv.services.tenants import TenantIncarnation
from tenantkv.tenant_assertion import ASSERTION_PARAM, AssertionSigner, AssertionVerifier

INCARNATION = "ab" * 16
SECRET = b"s" * 32
LEAK = {"kv_transfer_params": {ASSERTION_PARAM: "leaked"}, "tenantkv_debug": "leaked"}


class Directory:
    """The tenants a hook sees: name -> incarnation; ``broken`` makes every lookup fail."""

    def __init__(self, *names: str, broken: bool = False) -> None:
        self.names = set(names)
        self.broken = broken

    def tenant_incarnation(self, name: str) -> TenantIncarnation | None:
        if self.broken:
            raise CacheUnavailableError("index down")
        if not name.isidentifier():
            raise InvalidRequestError("not a tenant name")
        return TenantIncarnation(name, INCARNATION, 0.0) if name in self.names else None


def refused(call: Callable[[], object]) -> HTTPException:
    try:
        call()
    except HTTPException as err:
        return err
    raise AssertionError("not refused")


def check_identity_is_team_user_or_alias() -> None:
    directory = Directory("acme")
    key = UserAPIKeyAuth(api_key="k", token="t1", team_id="acme", user_id="alice", key_alias="a")
    found = litellm_identity(key, directory)
    assert (found.tenant, found.scope, found.incarnation) == ("acme", "alice", INCARNATION)
    aliased = UserAPIKeyAuth(api_key="k", team_id="acme", key_alias="billing-app")
    assert litellm_identity(aliased, directory).scope == "billing-app"
    assert litellm_identity(UserAPIKeyAuth(api_key="k", team_id="acme"), directory).scope is None


def check_keys_of_no_tenant_team_are_refused() -> None:
    directory = Directory("acme")
    teamless = refused(lambda: litellm_identity(UserAPIKeyAuth(api_key="k"), directory))
    assert teamless.status_code == 403 and "no team" in str(teamless.detail)
    stranger = UserAPIKeyAuth(api_key="k", team_id="globex")
    unknown = refused(lambda: litellm_identity(stranger, directory))
    assert unknown.status_code == 403 and "'globex'" in str(unknown.detail)
    odd = UserAPIKeyAuth(api_key="k", team_id="x" * 5000)  # quoted back, bounded
    long_refusal = refused(lambda: litellm_identity(odd, directory))
    assert long_refusal.status_code == 403 and len(str(long_refusal.detail)) < 200
    down = refused(lambda: litellm_identity(stranger, Directory(broken=True)))
    assert down.status_code == 503
    assert refused(lambda: litellm_identity(None, directory)).status_code == 401


def make_hook() -> tuple[TenantKVHook, AssertionVerifier]:
    signing = Ed25519PrivateKey.generate()
    hook = TenantKVHook(
        Directory("acme"),
        AssertionSigner(signing),
        secret=SECRET,
        settings=GatewaySettings(audience="aud", assertion_lifetime=30),
    )
    return hook, AssertionVerifier([signing.public_key()], audience="aud")


def check_pre_call_strips_then_stamps() -> None:
    hook, verifier = make_hook()
    key = UserAPIKeyAuth(api_key="k", token="t1", team_id="acme", user_id="alice")
    data = {
        "model": "m",
        "prompt": "hello",
        "cache_salt": "client",
        "extra_body": {"Cache-Salt": "client", "kv_transfer_params": {"x": 1}, "top_k": 3},
        "metadata": {"tenantkv_tenant": "globex", "user": "u"},
    }
    out = asyncio.run(hook.async_pre_call_hook(key, None, data, "text_completion"))
    assert out is data
    assert data["extra_body"] == {"top_k": 3} and data["metadata"] == {"user": "u"}
    identity = litellm_identity(key, hook.directory)
    assert data["cache_salt"] == cache_salt(SECRET, identity)
    assert set(data["kv_transfer_params"]) == {ASSERTION_PARAM}
    claims = verifier.verify(data["kv_transfer_params"][ASSERTION_PARAM])
    assert (claims.tenant, claims.scope, claims.incarnation) == ("acme", "alice", INCARNATION)
    # another call type reaches no KV cache: stripped, not stamped
    other = {"input": "x", "cache_salt": "client"}
    asyncio.run(hook.async_pre_call_hook(key, None, other, "aembedding"))
    assert other == {"input": "x"}
    # a refused key leaves nothing stamped
    stranger = UserAPIKeyAuth(api_key="k", team_id="globex")
    body: dict[str, object] = {"prompt": "x"}
    err = refused(lambda: asyncio.run(hook.async_pre_call_hook(stranger, None, body, "completion")))
    assert err.status_code == 403 and body == {"prompt": "x"}


def check_answers_lose_tenantkv_fields() -> None:
    hook, _ = make_hook()
    key = UserAPIKeyAuth(api_key="k", team_id="acme")
    text = TextCompletionResponse(
        id="x", model="m", choices=[{"index": 0, "text": "hi", **LEAK}], **LEAK
    )
    chat = ModelResponse(
        id="y",
        model="m",
        choices=[{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        **LEAK,
    )
    for answer in (text, chat):
        assert "leaked" in answer.model_dump_json()  # control: LiteLLM would pass it on
        out = asyncio.run(hook.async_post_call_success_hook({}, key, answer))
        dumped = json.loads(out.model_dump_json())
        assert "leaked" not in json.dumps(dumped), dumped
        assert dumped["id"] in {"x", "y"} and dumped["choices"]
    assert strip_answer({"a": [{"tenantkv_x": 1, "b": ({"kvTransferParams": 2},)}]}) == 2


def check_streamed_chunks_lose_tenantkv_fields() -> None:
    hook, _ = make_hook()
    key = UserAPIKeyAuth(api_key="k", team_id="acme")

    async def chunks() -> AsyncIterator[ModelResponseStream]:
        for i in range(3):
            yield ModelResponseStream(
                id="s", model="m", choices=[{"index": 0, "delta": {"content": str(i)}}], **LEAK
            )

    async def read() -> list[str]:
        out = hook.async_post_call_streaming_iterator_hook(key, chunks(), {})
        return [chunk.model_dump_json() async for chunk in out]

    seen = asyncio.run(read())
    assert len(seen) == 3 and not any("leaked" in s for s in seen), seen
    assert all(f'"content":"{i}"' in s for i, s in enumerate(seen)), seen


CHECKS = [value for name, value in sorted(globals().items()) if name.startswith("check_")]


def main() -> int:
    failed = 0
    for check in CHECKS:
        try:
            check()
        except Exception:
            failed += 1
            print(f"FAILED {check.__name__}", file=sys.stderr)
            traceback.print_exc()
    print(f"{len(CHECKS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
