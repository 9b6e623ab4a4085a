"""tenantkv's identity step as a LiteLLM proxy hook, for operators who already run LiteLLM in
front of ``vllm serve`` (tested with ``litellm[proxy]==1.106.12``, requirements/litellm.txt).

LiteLLM has authenticated the caller by the time its ``async_pre_call_hook`` runs; what it
knows is the key's :class:`UserAPIKeyAuth`. The hook turns that into the identity
``tenantkv gateway`` would have found, then takes the gateway's own step
(:func:`tenantkv.gateway.stamp.stamp`, the same function, so the rule cannot drift):

* **tenant** = the key's LiteLLM **team id** (create teams with the tenant's name as their
  ``team_id``). A key of no team, or of a team that is no tenantkv tenant (never created, or
  deleted), is refused with 403 and nothing goes upstream: serving it unsalted would put its
  prompts in a shared partition of vLLM's cache.
* **scope** = the key's ``user_id``, else its ``key_alias``, else none (the tenant's shared
  scope).
* **incarnation** = the tenant's current one, looked up in the cache's index on every request,
  so a tenant deleted and created again under the name shares nothing with its predecessor.

The body then loses every identity-bearing field the client sent, at any depth (including
``extra_body``, which LiteLLM merges into the upstream request), and gets the keyed
``cache_salt`` and ``kv_transfer_params = {"tenantkv_assertion": <signed>}``; LiteLLM's
OpenAI-compatible providers (``hosted_vllm/...``) pass both to vLLM in the request body.
Answers lose every identity-bearing field again (``async_post_call_success_hook`` and, for
streams, ``async_post_call_streaming_iterator_hook``), so an assertion never reaches a client.

Configuration is the deployment's one file: its ``[gateway]`` table gives the audience, the
assertion lifetime and the paths of the gateway secret and signing key (a LiteLLM proxy *is*
the deployment's gateway then; ``backends`` is LiteLLM's ``model_list`` and is not read), its
``[cache]`` table the index the tenants are looked up in. In LiteLLM's ``config.yaml``::

    litellm_settings:
      callbacks: tenantkv.integrations.litellm.hook   # reads the file TENANTKV_CONFIG names

``hook`` is built when LiteLLM loads it (at proxy start), so a bad file stops the proxy from
starting rather than letting it forward unstamped requests.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, Final, Protocol

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import UserAPIKeyAuth

from ..errors import InvalidRequestError, TenantKVError
from ..gateway.identity import GatewayIdentity
from ..gateway.scrub import identity_bearing, scrub
from ..gateway.settings import GatewaySettings, check_secret
from ..gateway.stamp import stamp
from ..services.tenants import TenantIncarnation
from ..settings_file import CONFIG_ENV
from ..tenant_assertion import AssertionSigner

logger = logging.getLogger("tenantkv")

#: LiteLLM call types whose body goes to vLLM's completion routes: these are stamped. Any
#: other call (embeddings, images...) is only stripped: it reaches no KV cache of tenantkv.
STAMPED_CALLS: Final = frozenset(
    {"completion", "acompletion", "text_completion", "atext_completion"}
)
#: Longest team id or scope quoted back in a refusal (the rest is cut: a refusal is bounded).
_QUOTED_CHARS: Final = 64


class TenantDirectory(Protocol):
    """Where the hook looks a tenant up (:class:`tenantkv.TenantKV` fits it)."""

    def tenant_incarnation(self, name: str) -> TenantIncarnation | None: ...


def refusal(status: int, message: str) -> HTTPException:
    """LiteLLM's way of rejecting a request from a hook: it answers ``status`` with this
    message and sends nothing upstream."""
    return HTTPException(status_code=status, detail={"error": f"tenantkv: {message}"})


def _quoted(value: str) -> str:
    return repr(value if len(value) <= _QUOTED_CHARS else value[:_QUOTED_CHARS] + "...")


def _label(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def litellm_identity(key: UserAPIKeyAuth | None, directory: TenantDirectory) -> GatewayIdentity:
    """The verified identity of a LiteLLM key: (its team, its user or alias, the team's tenant
    incarnation). Raises the :func:`refusal` for a call LiteLLM authenticated no key for (401),
    a key of no team or of a team that is no tenant (403), or when the index cannot answer
    (503)."""
    if key is None:
        raise refusal(401, "no authenticated key")
    team = _label(key.team_id)
    if team is None:
        raise refusal(403, "this key belongs to no team; only team keys are served")
    scope = _label(key.user_id) or _label(key.key_alias)
    try:
        found = directory.tenant_incarnation(team)
    except InvalidRequestError:  # a team id that cannot name a tenant
        found = None
    except TenantKVError:
        logger.exception("litellm hook: the tenant of team %s cannot be looked up", _quoted(team))
        raise refusal(503, "tenants cannot be looked up now; retry") from None
    if found is None:
        raise refusal(403, f"team {_quoted(team)} is no tenantkv tenant")
    return GatewayIdentity(
        key_id=_label(key.token) or "", tenant=team, scope=scope, incarnation=found.incarnation
    )


def _drop_bearing_keys(mapping: dict[Any, Any]) -> int:
    names = [k for k in mapping if identity_bearing(k)]
    for name in names:
        del mapping[name]
    return len(names)


def strip_answer(answer: object) -> int:
    """Remove, in place, every identity-bearing field of an answer LiteLLM is about to send:
    keys of dicts and attributes of its response objects (pydantic models, whose unknown
    upstream fields live in ``__pydantic_extra__``), at any depth. The number removed.

    :func:`~tenantkv.gateway.scrub.scrub` walks JSON; LiteLLM's answers are objects holding
    JSON, so this walk visits both, with scrub's rule (:func:`identity_bearing`) for names."""
    removed = 0
    seen: set[int] = set()
    stack = [answer]
    while stack:
        node = stack.pop()
        if node is None or isinstance(node, str | bytes | int | float) or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, dict):
            removed += _drop_bearing_keys(node)
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
        elif hasattr(node, "__dict__"):
            extra = getattr(node, "__pydantic_extra__", None)
            if isinstance(extra, dict):
                removed += _drop_bearing_keys(extra)
                stack.extend(extra.values())
            fields = vars(node)
            for name in [n for n in fields if identity_bearing(n)]:
                setattr(node, name, None)  # a declared field cannot be deleted; it goes empty
                removed += 1
            stack.extend(v for n, v in fields.items() if not n.startswith("_"))
    return removed


class TenantKVHook(CustomLogger):  # type: ignore[misc]
    """The LiteLLM proxy hook (see the module). ``directory`` is the cache whose tenants the
    teams are; the signer, secret and settings are those of ``tenantkv gateway``."""

    def __init__(
        self,
        directory: TenantDirectory,
        signer: AssertionSigner,
        *,
        secret: bytes,
        settings: GatewaySettings,
    ) -> None:
        super().__init__()
        self.directory = directory
        self.signer = signer
        self.secret = check_secret(secret)
        self.settings = settings

    def identify(self, key: UserAPIKeyAuth | None) -> GatewayIdentity:
        return litellm_identity(key, self.directory)

    def rewrite(self, data: dict[str, Any], identity: GatewayIdentity, call_type: str) -> None:
        """Strip ``data`` and, for a completion call, stamp it with ``identity``."""
        if call_type not in STAMPED_CALLS:
            scrub(data)
            return
        try:
            stamp(data, identity, signer=self.signer, secret=self.secret, settings=self.settings)
        except InvalidRequestError:
            logger.error(
                "litellm hook: key %r has an identity that cannot be signed", identity.key_id
            )
            raise refusal(403, "this key's identity cannot be served") from None

    async def async_pre_call_hook(
        self,
        user_api_key_dict: UserAPIKeyAuth | None,
        cache: Any,
        data: dict[str, Any],
        call_type: str,
    ) -> dict[str, Any]:
        # the index lookup may wait on the database: not on LiteLLM's event loop
        identity = await asyncio.to_thread(self.identify, user_api_key_dict)
        self.rewrite(data, identity, call_type)
        return data

    async def async_post_call_success_hook(
        self, data: dict[str, Any], user_api_key_dict: UserAPIKeyAuth, response: Any
    ) -> Any:
        strip_answer(response)
        return response

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: UserAPIKeyAuth, response: Any, request_data: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        async for chunk in response:
            strip_answer(chunk)
            yield chunk


def _read_secret(path: str) -> bytes:
    data = Path(path).read_bytes().strip()
    if not data:
        raise InvalidRequestError(f"{path} is empty")
    return data


def hook_from_config_file(
    config_file: str | os.PathLike[str],
    open_directory: Callable[[str], TenantDirectory] | None = None,
) -> TenantKVHook:
    """The hook a deployment's configuration file describes (see the module); the cache is
    opened by ``open_directory(config_file)`` (default: its ``[cache]`` table, an existing
    cache). An :class:`~tenantkv.errors.InvalidRequestError` naming what is missing or bad."""
    from ..gateway.config_section import load_gateway_table

    table = load_gateway_table(config_file)
    missing = [n for n in ("audience", "secret_file", "signing_key_file") if not getattr(table, n)]
    if missing:
        raise InvalidRequestError(
            f"{config_file}: the [gateway] table needs {', '.join(missing)} for the LiteLLM hook"
        )
    assert table.secret_file and table.signing_key_file, "checked above"
    directory = (open_directory or _open_cache)(os.fspath(config_file))
    return TenantKVHook(
        directory,
        AssertionSigner(Path(table.signing_key_file).read_bytes()),
        secret=_read_secret(table.secret_file),
        settings=table.settings(),
    )


def _open_cache(config_file: str) -> TenantDirectory:
    from .. import open as open_cache
    from ..config import CacheConfig

    return open_cache(CacheConfig.from_env(config_file=config_file), create=False)


@functools.cache
def _hook_from_environment() -> TenantKVHook:
    path = os.environ.get(CONFIG_ENV)
    if not path:
        raise InvalidRequestError(
            f"tenantkv.integrations.litellm.hook reads the configuration file {CONFIG_ENV} "
            "names, and it is not set"
        )
    return hook_from_config_file(path)


def __getattr__(name: str) -> Any:
    """``hook``: the instance LiteLLM's ``callbacks:`` names, built on first access."""
    if name == "hook":
        return _hook_from_environment()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
