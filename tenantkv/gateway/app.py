"""The gateway's web application: authenticate, strip, salt, sign, route, forward, clean.

For each ``POST /v1/completions`` or ``/v1/chat/completions``:

1. the ``Authorization: Bearer <key>`` is looked up by the :class:`KeyAuthenticator`; an unknown,
   revoked or expired key is 401 and nothing goes upstream;
2. the key's concurrency slot is taken (429 when all are in use);
3. the body is read up to ``max_body_bytes`` (413 beyond) and parsed (400 if it is not a JSON
   object);
4. every identity-bearing field is removed at any depth (:mod:`scrub`), then ``cache_salt``
   is set to the keyed hash of the verified identity and ``kv_transfer_params`` to
   ``{ASSERTION_PARAM: <signed assertion>}``, which is what the vLLM connector reads (one
   function, :mod:`stamp`, shared with the LiteLLM hook);
5. the backends are ranked by the keyed digest of the identity and the prompt's first block
   (:mod:`routing`); one that cannot be connected to is skipped for the next;
6. the answer (JSON, or server-sent events as they arrive) loses every identity-bearing field;
   ``usage`` passes. An upstream that is silent past ``upstream_timeout`` is 504, one that
   fails or answers 5xx is 502; the client never sees a stack trace or the upstream's error text.

Only allow-listed request headers go upstream (:mod:`headers`): never the client's
``Authorization``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from ..errors import InvalidRequestError, TenantKVError
from ..tenant_assertion import AssertionSigner
from .headers import clean_value, forwarded_headers
from .identity import IdentityLike, KeyAuthenticator
from .keyed import affinity_digest
from .limits import KeyLimiter, Lease
from .routing import Router
from .scrub import scrub
from .settings import GatewaySettings, check_backends, check_secret
from .stamp import stamp
from .streaming import EventStream
from .upstream import SplitPoolTransport

logger = logging.getLogger("tenantkv")

#: The OpenAI routes proxied (POST, JSON body).
ROUTES: Final = ("/v1/completions", "/v1/chat/completions")
_MAX_KEY_CHARS: Final = 512


class Refusal(Exception):
    """A request the gateway answers itself with an OpenAI-shaped error (never a trace)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message

    def response(self) -> JSONResponse:
        return error_response(self.status, self.kind, self.message)


def error_response(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )


def bearer_key(request: Request) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, if there is a clean one."""
    raw = request.headers.get("authorization")
    if raw is None:
        return None
    scheme, _, key = raw.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key or len(key) > _MAX_KEY_CHARS:
        return None
    return key if clean_value(key.encode("utf-8", "replace")) else None


class Gateway:
    """The state behind the routes: the authenticator, signer, router, limits and the upstream
    client (made in the serving loop on first use)."""

    def __init__(
        self,
        authenticator: KeyAuthenticator,
        signer: AssertionSigner,
        *,
        secret: bytes,
        backends: Sequence[str],
        settings: GatewaySettings,
    ) -> None:
        self.authenticator = authenticator
        self.signer = signer
        self.secret = check_secret(secret)
        self.settings = settings
        self.router = Router(check_backends(list(backends)), cooldown=settings.backend_cooldown)
        self.limits = KeyLimiter(settings.max_concurrency_per_key)
        self._client: httpx.AsyncClient | None = None
        # backend URL + route -> parsed once (parsing a URL is a tenth of httpx's cost per
        # request); bounded by the backends times the few routes
        self._urls: dict[tuple[str, str], httpx.URL] = {}

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            s = self.settings
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(s.upstream_timeout, connect=s.connect_timeout),
                transport=SplitPoolTransport(s.max_connections),  # keep-alive, see upstream.py
                trust_env=False,  # no proxy or credentials taken from the environment
                follow_redirects=False,
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ---------------------------------------------------------------- the request's steps

    async def identify(self, request: Request) -> IdentityLike:
        key = bearer_key(request)
        if key is None:
            raise Refusal(401, "invalid_api_key", "an Authorization: Bearer <key> is required")
        try:
            identity = await run_in_threadpool(self.authenticator.authenticate, key)
        except TenantKVError:  # the key service could not answer: neither a 401 nor a 500
            raise Refusal(503, "unavailable", "keys cannot be checked now; retry") from None
        if identity is None:
            raise Refusal(401, "invalid_api_key", "unknown, revoked or expired key")
        return identity

    async def read_body(self, request: Request) -> dict[str, Any]:
        limit = self.settings.max_body_bytes
        too_large = Refusal(413, "request_too_large", f"the body is larger than {limit} bytes")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise too_large
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError):
            raise Refusal(400, "invalid_request_error", "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise Refusal(400, "invalid_request_error", "the body must be a JSON object")
        return body

    def rewrite(self, body: dict[str, Any], identity: IdentityLike) -> bytes:
        """The body as it goes upstream: stripped, then salted and given the assertion."""
        try:
            stamp(body, identity, signer=self.signer, secret=self.secret, settings=self.settings)
        except InvalidRequestError:
            logger.error("gateway: key %r has an identity that cannot be signed", identity.key_id)
            raise Refusal(500, "internal_error", "the key's identity cannot be served") from None
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    async def send(
        self, method: str, path: str, digest: bytes, headers: dict[str, str], content: bytes | None
    ) -> httpx.Response:
        """The first backend in rank that accepts the connection, its response streaming."""
        for url in self.router.rank(digest):
            target = self._urls.get((url, path))
            if target is None:
                target = self._urls[url, path] = httpx.URL(url + path)
            upstream = self.client.build_request(method, target, headers=headers, content=content)
            try:
                response = await self.client.send(upstream, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                self.router.failed(url)
                logger.warning("gateway: backend %s could not be reached; trying the next", url)
                continue
            except httpx.TimeoutException:
                raise Refusal(
                    504, "upstream_timeout", "the backend did not answer in time"
                ) from None
            except httpx.HTTPError:
                raise Refusal(502, "upstream_error", "the backend failed") from None
            self.router.answered(url)
            return response
        raise Refusal(502, "upstream_unreachable", "no backend could be reached")

    async def read_answer(self, response: httpx.Response) -> Response:
        """A whole upstream answer, cleaned; the upstream's 5xx text is not passed on."""
        try:
            if response.status_code >= 500:
                raise Refusal(502, "upstream_error", "the backend failed")
            limit = self.settings.max_response_bytes
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise Refusal(502, "upstream_error", "the backend's answer is too large")
                chunks.append(chunk)
        except httpx.TimeoutException:
            raise Refusal(504, "upstream_timeout", "the backend did not answer in time") from None
        except httpx.HTTPError:
            raise Refusal(502, "upstream_error", "the backend failed") from None
        finally:
            await response.aclose()
        raw = b"".join(chunks)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            raise Refusal(502, "upstream_error", "the backend's answer is not JSON") from None
        if scrub(data):
            return JSONResponse(data, status_code=response.status_code)
        # nothing removed: the upstream's own bytes, not a second encoding of the same JSON
        return Response(raw, status_code=response.status_code, media_type="application/json")

    async def proxy(self, request: Request, path: str) -> Response:
        identity = await self.identify(request)
        lease = self.limits.acquire(identity.key_id)
        if lease is None:
            raise Refusal(429, "rate_limit_exceeded", "too many requests in flight for this key")
        try:
            return await self._proxy_with(lease, request, path, identity)
        except BaseException:
            lease.release()
            raise

    async def _proxy_with(
        self, lease: Lease, request: Request, path: str, identity: IdentityLike
    ) -> Response:
        body = await self.read_body(request)
        s = self.settings
        digest = affinity_digest(
            self.secret, identity, body, chars=s.affinity_chars, messages=s.affinity_messages
        )
        content = self.rewrite(body, identity)
        headers = forwarded_headers(request.headers.raw)
        response = await self.send("POST", path, digest, headers, content)
        streamed = response.status_code == 200 and response.headers.get(
            "content-type", ""
        ).startswith("text/event-stream")
        if streamed:
            return EventStream(response, lease.release)
        answer = await self.read_answer(response)
        lease.release()
        return answer

    async def models(self, request: Request) -> Response:
        identity = await self.identify(request)
        digest = affinity_digest(self.secret, identity, {}, chars=1, messages=1)
        headers = forwarded_headers(request.headers.raw)
        return await self.read_answer(await self.send("GET", "/v1/models", digest, headers, None))

    async def ready(self) -> bool:
        """Whether at least one backend answers its ``/health`` with a 2xx in time."""

        async def probe(url: str) -> bool:
            try:
                answer = await self.client.get(
                    url + "/health", timeout=self.settings.health_timeout
                )
            except httpx.HTTPError:
                return False
            return answer.is_success

        results = await asyncio.gather(*(probe(url) for url in self.router.backends))
        return any(results)


def create_gateway_app(
    authenticator: KeyAuthenticator,
    signer: AssertionSigner,
    *,
    secret: bytes,
    backends: Sequence[str],
    settings: GatewaySettings,
    cache_health: Callable[[], Any] | None = None,
) -> FastAPI:
    """The gateway as an ASGI application (serve it with uvicorn). ``cache_health`` (the
    cache's ``kv.health``, when the gateway has one) joins ``/readyz``."""
    gateway = Gateway(authenticator, signer, secret=secret, backends=backends, settings=settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(
        title="tenantkv gateway", openapi_url=None, docs_url=None, redoc_url=None, lifespan=lifespan
    )
    app.state.gateway = gateway

    @app.exception_handler(Refusal)
    async def refused(_: Request, err: Refusal) -> Response:
        return err.response()

    @app.exception_handler(Exception)
    async def failed(_: Request, err: Exception) -> Response:
        logger.exception("gateway: unexpected error")
        return error_response(500, "internal_error", "the gateway failed")

    for path in ROUTES:

        async def route(request: Request, _path: str = path) -> Response:
            return await gateway.proxy(request, _path)

        # a plain Starlette route: the handler reads the request itself, so FastAPI's
        # parameter and dependency machinery would only cost time on every request
        app.router.add_route(path, route, methods=["POST"], include_in_schema=False)

    @app.get("/v1/models", include_in_schema=False)
    async def models(request: Request) -> Response:
        return await gateway.models(request)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> Response:
        if cache_health is not None:
            report = await run_in_threadpool(cache_health)
            if not report.ready:
                failed = ", ".join(f"{k}: {v}" for k, v in report.checks.items() if v != "ok")
                return error_response(503, "not_ready", f"the cache is not ready ({failed})")
        if await gateway.ready():
            return JSONResponse({"status": "ready"})
        return error_response(503, "not_ready", "no backend answers /health")

    return app
