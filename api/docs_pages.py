"""``/docs`` (Swagger UI) and ``/redoc`` served from this host, so they work offline.

FastAPI's own pages load their scripts and styles from a CDN and stay blank without one. The
assets come from the ``fastapi-offline`` distribution (part of the ``server`` extra), which
ships Swagger UI 5 (OpenAPI 3.1, as FastAPI writes it) and ReDoc; they are mounted at
``/docs/assets``.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

__all__ = ["ASSETS_URL", "install_docs_pages"]

ASSETS_URL = "/docs/assets"
_ASSETS = Path(fastapi_offline.__file__).resolve().parent / "static"


def install_docs_pages(app: FastAPI) -> None:
    """Add ``/docs``, its OAuth2 redirect, ``/redoc`` and their assets to ``app`` (created
    with ``docs_url=None, redoc_url=None``)."""
    openapi_url = app.openapi_url or "/openapi.json"
    redirect_url = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"
    app.mount(ASSETS_URL, StaticFiles(directory=_ASSETS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=f"{root}{redirect_url}",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
        )

    @app.get(redirect_url, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )
