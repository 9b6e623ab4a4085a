"""LiteLLM's proxy (``litellm[proxy]``, requirements/litellm.txt, in .venv-litellm, which
scripts/setup_litellm.sh builds) as a child process on 127.0.0.1 in front of any OpenAI-shaped
backend, with tenantkv's hook as its callback.

Its own venv because LiteLLM's proxy pins FastAPI, pydantic and friends to versions of its
own, which need not agree with vLLM's; the test talks to it over HTTP only.

Keys and teams without a database: LiteLLM keeps virtual keys and teams in PostgreSQL through
Prisma, whose engines are binaries Prisma downloads at run time (nothing outside the package
registries can be reached here). So the proxy authenticates by LiteLLM's documented
``general_settings.custom_auth``, a function returning the ``UserAPIKeyAuth`` the key stands
for (team id, user id, alias) -- the same object its database-backed auth builds, and all the
hook reads. :func:`litellm_proxy` writes that function from a dict of keys.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.doc_recipes import fenced_blocks
from tests.ports import free_port
from tests_engines.hosted import stop, wait_until_healthy

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv-litellm" / "bin" / "python"

_AUTH_MODULE = '''"""The test's keys: key -> the UserAPIKeyAuth LiteLLM would build from its DB."""
import json

from litellm.proxy._types import UserAPIKeyAuth

KEYS = json.loads({keys!r})


async def user_api_key_auth(request, api_key):
    found = KEYS.get(api_key.removeprefix("Bearer ").strip())
    if found is None:
        raise Exception("unknown key")
    return UserAPIKeyAuth(api_key=api_key, token=found.pop("token", None), **found)
'''


@dataclass(frozen=True)
class TeamKey:
    """What a LiteLLM key stands for (None: not set on the key)."""

    team_id: str | None
    user_id: str | None = None
    key_alias: str | None = None


def documented_config() -> dict[str, Any]:
    """The LiteLLM ``config.yaml`` of docs/engines.md ("Identity in any other gateway")."""
    (block,) = fenced_blocks("engines.md", "yaml")
    config: dict[str, Any] = yaml.safe_load(block)
    return config


def proxy_config(backend_url: str, model: str) -> str:
    """LiteLLM's config.yaml (JSON is YAML): one model on the backend, tenantkv's hook, the
    keys of :data:`_AUTH_MODULE`."""
    config = {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {
                    "model": f"hosted_vllm/{model}",
                    "api_base": backend_url + "/v1",
                    "api_key": "unused",
                },
            }
        ],
        # as docs/engines.md configures the hook (the page's snippet, read here)
        "litellm_settings": documented_config()["litellm_settings"],
        "general_settings": {
            "custom_auth": "team_keys.user_api_key_auth",
            "master_key": "sk-" + secrets.token_hex(32),  # LiteLLM refuses to start without
        },
    }
    return json.dumps(config, indent=2)


@contextmanager
def litellm_proxy(
    backend_url: str,
    *,
    model: str,
    tenantkv_config: Path,
    keys: Mapping[str, TeamKey],
    workdir: Path,
) -> Iterator[str]:
    """LiteLLM's proxy in front of ``backend_url`` serving ``model``, its hook configured by
    ``tenantkv_config``; yields its base URL and stops it on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(proxy_config(backend_url, model), encoding="utf-8")
    table = {
        key: {**asdict(spec), "token": f"hashed-{i}"} for i, (key, spec) in enumerate(keys.items())
    }
    (workdir / "team_keys.py").write_text(
        _AUTH_MODULE.format(keys=json.dumps(table)), encoding="utf-8"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DATABASE_URL", "LITELLM_", "TENANTKV_"))
    }
    env |= {
        "TENANTKV_CONFIG": str(tenantkv_config),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the price list from the internet
        "NO_PROXY": "127.0.0.1,localhost",
    }
    command = [
        str(PYTHON), "-c", "from litellm.proxy.proxy_cli import run_server; run_server()",
        "--config", str(workdir / "config.yaml"), "--host", "127.0.0.1", "--port", str(port),
        "--num_workers", "1",
    ]  # fmt: skip
    log = workdir / "litellm.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_until_healthy(process, url, log, probe="/health/liveliness", name="the LiteLLM proxy")
        yield url
    finally:
        stop(process)
