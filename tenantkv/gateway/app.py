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

The two proxied routes are the hot path, and are served without the framework's machinery:
:class:`GatewayApp` hands their POSTs straight to :meth:`Gateway.handle` over ASGI, the body goes
upstream through the gateway's own HTTP/1.1 client (:mod:`client`), and answers are sent as raw
ASGI messages. The other routes are ordinary FastAPI routes. Where the time went before and
after: docs/perf.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from ..errors import InvalidRequestError, TenantKVError
from ..tenant_assertion import AssertionSigner
from .client import ConnectFailed, UpstreamClient, UpstreamError, UpstreamResponse, UpstreamTimeout
from .headers import clean_value, forwarded_headers
from .identity import IdentityLike, KeyAuthenticator
from .keyed import affinity_digest
from .limits import KeyLimiter, Lease
from .routing import Router
from .scrub import may_bear, scrub
from .settings import GatewaySettings, check_backends, check_secret
from .stamp import stamp
from .streaming import EventStream
from .upstream import SplitPoolTransport

logger = logging.getLogger("tenantkv")

#: The OpenAI routes proxied (POST, JSON body).
ROUTES: Final = ("/v1/completions", "/v1/chat/completions")
_MAX_KEY_CHARS: Final = 512
#: Threads that run key lookups (the key service may block on its index). As many as
#: Starlette's default thread pool has tokens, which the gateway used before.
KEY_LOOKUP_THREADS: Final = 40


class Refusal(Exception):
    """A request the gateway answers itself with an OpenAI-shaped error (never a trace)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message

    def response(self) -> JSONResponse:
        return error_response(self.status, self.kind, self.message)

    def answer(self) -> Answer:
        return Answer(self.status, _error_body(self.status, self.kind, self.message))


def _error_body(status: int, kind: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse(_error_body(status, kind, message), status_code=status)


class Answer:
    """A whole JSON answer sent straight over ASGI (the proxied routes use no Response class:
    Starlette's middleware and response machinery cost more than the rest of the route)."""

    __slots__ = ("body", "status")

    def __init__(self, status: int, body: bytes | dict[str, Any]) -> None:
        self.status = status
        self.body = body if isinstance(body, bytes) else _json_bytes(body)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": self.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(self.body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": self.body})


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class _ClientGone(Exception):
    """The client disconnected before its request was read: nobody to answer."""


class UpstreamAnswer(Protocol):
    """What :meth:`Gateway.read_answer` reads: httpx's response or :class:`UpstreamResponse`."""

    @property
    def status_code(self) -> int: ...
    def aiter_bytes(self) -> AsyncIterator[bytes]: ...
    async def aclose(self) -> None: ...


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of request header ``name`` (ASGI names are lowercase)."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def bearer_key(raw: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value, if there is a clean one."""
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
        # key lookups run here rather than through anyio's to_thread, whose bookkeeping per
        # call (a capacity limiter, run variables, a cancel scope) was most of the Python
        # time left per proxied request once the upstream client was replaced (docs/perf.md)
        self._lookups: concurrent.futures.ThreadPoolExecutor | None = None
        self._upstream: UpstreamClient | None = None
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

    @property
    def upstream(self) -> UpstreamClient:
        """The client of the proxied requests (:mod:`client`); made in the serving loop."""
        if self._upstream is None:
            s = self.settings
            self._upstream = UpstreamClient(
                max_connections=s.max_connections,
                connect_timeout=s.connect_timeout,
                read_timeout=s.upstream_timeout,
            )
        return self._upstream

    async def close(self) -> None:
        if self._upstream is not None:
            await self._upstream.aclose()
            self._upstream = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._lookups is not None:
            self._lookups.shutdown(wait=False)
            self._lookups = None

    # ---------------------------------------------------------------- the request's steps

    async def identify(self, authorization: str | None) -> IdentityLike:
        key = bearer_key(authorization)
        if key is None:
            raise Refusal(401, "invalid_api_key", "an Authorization: Bearer <key> is required")
        try:
            if self._lookups is None:
                self._lookups = concurrent.futures.ThreadPoolExecutor(
                    KEY_LOOKUP_THREADS, thread_name_prefix="tenantkv-gateway-keys"
                )
            identity = await asyncio.get_running_loop().run_in_executor(
                self._lookups, self.authenticator.authenticate, key
            )
        except TenantKVError:  # the key service could not answer: neither a 401 nor a 500
            raise Refusal(503, "unavailable", "keys cannot be checked now; retry") from None
        if identity is None:
            raise Refusal(401, "invalid_api_key", "unknown, revoked or expired key")
        return identity

    async def read_body(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        limit = self.settings.max_body_bytes
        too_large = Refusal(413, "request_too_large", f"the body is larger than {limit} bytes")
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise too_large
        chunks: list[bytes] = []
        size = 0
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
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
        return _json_bytes(body)

    async def send(
        self, method: str, path: str, digest: bytes, headers: dict[str, str], content: bytes | None
    ) -> httpx.Response:
        """The first backend in rank that accepts the connection, its response streaming
        (httpx: the cold routes)."""
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

    async def forward(
        self, path: str, digest: bytes, headers: dict[str, str], content: bytes
    ) -> UpstreamResponse:
        """POST to the first backend in rank that accepts the connection (:mod:`client`); the
        answer once its headers are in, its body still to read."""
        for url in self.router.rank(digest):
            try:
                response = await self.upstream.request(b"POST", url, path, headers, content)
            except ConnectFailed:
                self.router.failed(url)
                logger.warning("gateway: backend %s could not be reached; trying the next", url)
                continue
            except UpstreamTimeout:
                raise Refusal(
                    504, "upstream_timeout", "the backend did not answer in time"
                ) from None
            except UpstreamError:
                raise Refusal(502, "upstream_error", "the backend failed") from None
            self.router.answered(url)
            return response
        raise Refusal(502, "upstream_unreachable", "no backend could be reached")

    async def read_answer(self, response: UpstreamAnswer) -> Answer:
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
        except (httpx.TimeoutException, UpstreamTimeout):
            raise Refusal(504, "upstream_timeout", "the backend did not answer in time") from None
        except (httpx.HTTPError, UpstreamError):
            raise Refusal(502, "upstream_error", "the backend failed") from None
        finally:
            await response.aclose()
        raw = b"".join(chunks)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            raise Refusal(502, "upstream_error", "the backend's answer is not JSON") from None
        # the walk only where a key could be removed (scrub.may_bear is the proof otherwise)
        if may_bear(raw) and scrub(data):
            return Answer(response.status_code, data)
        # nothing removed: the upstream's own bytes, not a second encoding of the same JSON
        return Answer(response.status_code, raw)

    async def handle(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """One proxied request, over ASGI; whatever ends it, an answer or a clean stop."""
        try:
            reply = await self.proxy(scope, receive, path)
        except Refusal as refusal:
            reply = refusal.answer()
        except _ClientGone:
            return
        except Exception:
            logger.exception("gateway: unexpected error")
            reply = Answer(500, _error_body(500, "internal_error", "the gateway failed"))
        await reply(scope, receive, send)

    async def proxy(
        self, scope: Scope, receive: Receive, path: str
    ) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        authorization = _header(scope, b"authorization")
        identity = await self.identify(
            None if authorization is None else authorization.decode("latin-1")
        )
        lease = self.limits.acquire(identity.key_id)
        if lease is None:
            raise Refusal(429, "rate_limit_exceeded", "too many requests in flight for this key")
        try:
            return await self._proxy_with(lease, scope, receive, path, identity)
        except BaseException:
            lease.release()
            raise

    async def _proxy_with(
        self, lease: Lease, scope: Scope, receive: Receive, path: str, identity: IdentityLike
    ) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        body = await self.read_body(scope, receive)
        s = self.settings
        digest = affinity_digest(
            self.secret, identity, body, chars=s.affinity_chars, messages=s.affinity_messages
        )
        content = self.rewrite(body, identity)
        headers = forwarded_headers(scope["headers"])
        response = await self.forward(path, digest, headers, content)
        kind = response.header(b"content-type") or b""
        if response.status_code == 200 and kind.startswith(b"text/event-stream"):
            return EventStream(response, lease.release)
        answer = await self.read_answer(response)
        lease.release()
        return answer

    async def models(self, request: Request) -> Response:
        authorization = request.headers.get("authorization")
        identity = await self.identify(authorization)
        digest = affinity_digest(self.secret, identity, {}, chars=1, messages=1)
        headers = forwarded_headers(request.headers.raw)
        answer = await self.read_answer(await self.send("GET", "/v1/models", digest, headers, None))
        return Response(answer.body, status_code=answer.status, media_type="application/json")

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


class ProxyRoute:
    """The ASGI endpoint of one proxied path."""

    def __init__(self, gateway: Gateway, path: str) -> None:
        self.gateway = gateway
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.gateway.handle(scope, receive, send, self.path)


class GatewayApp(FastAPI):
    """The gateway's FastAPI application, whose proxied routes skip the framework: a POST to
    one of :data:`ROUTES` goes straight to :meth:`Gateway.handle`, which answers every error
    itself. Starlette's middleware stack, router and request object were a fifth of the
    gateway's time per request (docs/perf.md); the other routes keep all of it."""

    def __init__(self, gateway: Gateway, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hot = {path: ProxyRoute(gateway, path) for path in ROUTES}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            route = self._hot.get(scope["path"])
            if route is not None:
                await route(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


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

    app = GatewayApp(
        gateway,
        title="tenantkv gateway",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
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
        # reached only where GatewayApp does not take the request first (a root path set
        # by the server); other methods get the router's 405
        app.router.routes.append(Route(path, ProxyRoute(gateway, path), methods=["POST"]))

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
