"""The admin console (``/docs``, Swagger UI) served from this host: no CDN.

FastAPI's default ``/docs`` page loads Swagger UI's script and stylesheet from a CDN, so on an
admin host without Internet access (the usual place for a key-holding service) it is blank. The
``server`` extra installs ``swagger-ui-bundle`` (Swagger UI's files in a Python package,
Apache-2.0), and this module serves its two files and a favicon under ``/docs/`` from memory.
Without the package ``/docs`` is simply absent (a logged warning), never pointed at a CDN. ReDoc
has no such package, so ``/redoc`` is off.

The pages and assets are public like ``/openapi.json`` (the schema describes routes, not
tenants); every call made from the page still needs a token.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.responses import HTMLResponse, Response

logger = logging.getLogger("tenantkv")

DOCS_URL: Final = "/docs"
#: URL under /docs -> (file of the bundle, media type)
_ASSETS: Final = {
    f"{DOCS_URL}/swagger-ui-bundle.js": ("swagger-ui-bundle.js", "text/javascript"),
    f"{DOCS_URL}/swagger-ui.css": ("swagger-ui.css", "text/css"),
    f"{DOCS_URL}/favicon.png": ("favicon-32x32.png", "image/png"),
}


def _bundle_dir() -> Path | None:
    try:
        from swagger_ui_bundle import swagger_ui_path  # type: ignore[import-untyped]
    except ImportError:
        return None
    return Path(swagger_ui_path)


def install(app: FastAPI, *, title: str) -> set[str]:
    """Add ``/docs`` and its assets to ``app`` (created with ``docs_url=None``); return the
    paths to make public (none when Swagger UI's files are not installed)."""
    bundle = _bundle_dir()
    if bundle is None or app.openapi_url is None:
        logger.warning(
            "the admin console (/docs) is off: install swagger-ui-bundle (the server extra)"
        )
        return set()
    assets = {url: (bundle / name, media) for url, (name, media) in _ASSETS.items()}
    openapi_url = app.openapi_url

    async def page() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{title} - console",
            swagger_js_url=f"{DOCS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_URL}/favicon.png",
        )

    app.add_api_route(DOCS_URL, page, methods=["GET"], include_in_schema=False)
    for url, (path, media) in assets.items():
        app.add_api_route(url, _asset(path, media), methods=["GET"], include_in_schema=False)
    return {DOCS_URL, *assets}


def _asset(path: Path, media: str) -> Callable[[], Awaitable[Response]]:
    """A route answering ``path``'s bytes (read once: a few MB at most)."""
    body = path.read_bytes()

    async def asset() -> Response:
        return Response(body, media_type=media, headers={"Cache-Control": "public, max-age=86400"})

    return asset
