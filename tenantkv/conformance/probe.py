"""One request of the suite, as a client sends it, and what it tells: the cached prompt tokens
vLLM reports and the time to the first token.

Plain ``httpx`` (the gateway extra has it) rather than the ``openai`` client: the suite needs
the raw server-sent events to time the first token, and the exact JSON it sends, attacks
included (``cache_salt``, ``kv_transfer_params``), which the client would have to smuggle
through ``extra_body`` anyway.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import httpx

from ..errors import DeploymentError

ENTRYPOINTS: Final = ("completions", "chat")
_PATHS: Final = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Observation:
    """What one answer showed: ``cached`` is ``usage.prompt_tokens_details.cached_tokens``
    (None where the deployment does not report it: then hits are read from ``ttft``), ``ttft``
    the seconds to the first streamed token, or to the whole answer when not streamed."""

    cached: int | None
    ttft: float
    prompt_tokens: int | None = None


def request_body(
    entrypoint: str, model: str, text: str, *, stream: bool, max_tokens: int, **extra: Any
) -> dict[str, Any]:
    """The JSON of a greedy request; ``extra``: fields sent as they are (the attacks')."""
    if entrypoint not in _PATHS:
        raise ValueError(f"entrypoint must be one of {ENTRYPOINTS}, not {entrypoint!r}")
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    if entrypoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


def cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` if the answer has it, else None."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    value = details.get("cached_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent event stream, up to ``data: [DONE]``."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise DeploymentError(f"a streamed event is not JSON: {data[:80]!r}") from None
        if isinstance(event, dict):
            yield event


def _has_token(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if choice.get("text") or (isinstance(delta, dict) and delta.get("content")):
            return True
        if choice.get("finish_reason"):
            return True  # a token that decodes to nothing still ends the prefill
    return False


class Prober:
    """Sends the suite's requests to one base URL (the gateway, or a backend directly)."""

    def __init__(self, client: httpx.Client, *, max_tokens: int = 1) -> None:
        self.client = client
        self.max_tokens = max_tokens

    def send(
        self,
        base_url: str,
        key: str | None,
        entrypoint: str,
        model: str,
        text: str,
        *,
        stream: bool,
        **extra: Any,
    ) -> Observation:
        """One request; a DeploymentError unless it is answered with a 200 of the OpenAI shape."""
        body = request_body(
            entrypoint, model, text, stream=stream, max_tokens=self.max_tokens, **extra
        )
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        url = base_url.rstrip("/") + _PATHS[entrypoint]
        started = time.perf_counter()
        try:
            if not stream:
                answer = self.client.post(url, json=body, headers=headers)
                elapsed = time.perf_counter() - started
                _check(answer, url)
                data = answer.json()
                usage = data.get("usage") if isinstance(data, dict) else None
                return Observation(cached_tokens(usage), elapsed, _prompt_tokens(usage))
            with self.client.stream("POST", url, json=body, headers=headers) as answer:
                if answer.status_code != 200:
                    answer.read()
                    _check(answer, url)
                first: float | None = None
                usage = None
                for event in sse_events(answer.iter_lines()):
                    if first is None and _has_token(event):
                        first = time.perf_counter() - started
                    if event.get("usage") is not None:
                        usage = event["usage"]
        except httpx.HTTPError as err:
            raise DeploymentError(f"{url}: {type(err).__name__}: {err}") from None
        except ValueError:
            raise DeploymentError(f"{url}: the answer is not JSON") from None
        if first is None:
            raise DeploymentError(f"{url}: the stream ended without a token")
        return Observation(cached_tokens(usage), first, _prompt_tokens(usage))

    def reset_prefix_cache(self, backend: str) -> None:
        """Empty vLLM's own prefix cache on ``backend`` (``POST /reset_prefix_cache``, served
        only when vLLM runs with ``VLLM_SERVER_DEV_MODE=1``)."""
        empty_prefix_cache(self.client, backend)


#: How long :func:`empty_prefix_cache` asks again while vLLM still holds blocks.
RESET_WITHIN_S: Final = 30.0


def empty_prefix_cache(client: httpx.Client, backend: str, within: float = RESET_WITHIN_S) -> None:
    """Empty vLLM's own prefix cache on ``backend``, asking again until it says it did.

    vLLM answers ``{"success": false}`` (still 200) while blocks are held: by running requests,
    or by a connector's saves still reading finished requests' pages (the tenantkv connector
    keeps them until its background save is done). A reset that did not happen must not pass
    for one: a hit after it would be read as the connector's when vLLM's own cache served it.
    Raises :class:`DeploymentError` when the cache is still not emptied after ``within`` s."""
    url = backend.rstrip("/") + "/reset_prefix_cache"
    deadline = time.monotonic() + within
    pause = 0.05
    while True:
        try:
            answer = client.post(url)
        except httpx.HTTPError as err:
            raise DeploymentError(f"{url}: {type(err).__name__}: {err}") from None
        _check(answer, url)
        try:
            emptied = answer.json().get("success") is True
        except (ValueError, AttributeError):
            raise DeploymentError(f"{url}: the answer is not vLLM's {{'success': ...}}") from None
        if emptied:
            return
        if time.monotonic() + pause > deadline:
            raise DeploymentError(
                f"{url}: vLLM's prefix cache was still not emptied after {within:g} s "
                "(blocks held by running requests or unfinished saves)"
            )
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


def _prompt_tokens(usage: Any) -> int | None:
    value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) else None


def _check(answer: httpx.Response, url: str) -> None:
    if answer.status_code != 200:
        raise DeploymentError(f"{url} answered {answer.status_code}: {answer.text[:200]}")
