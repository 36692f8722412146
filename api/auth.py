"""Optional bearer token on every ``/v1`` route, compared in constant time.

A pure ASGI middleware rather than a FastAPI dependency: it runs before routing and costs a
header scan per request, where a dependency costs a dependency-solver pass on the hot path.
The OpenAPI document still declares the scheme on every ``/v1`` operation.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from .responses import send_json_error

__all__ = ["PROTECTED_PREFIX", "BearerAuthMiddleware", "document_bearer"]

PROTECTED_PREFIX = "/v1/"
_CHALLENGE = b'Bearer realm="kvcache-offload"'


async def _refuse(send: Send, detail: str) -> None:
    await send_json_error(send, 401, "Unauthorized", detail, [(b"www-authenticate", _CHALLENGE)])


class BearerAuthMiddleware:
    """401 for ``/v1/...`` requests without ``Authorization: Bearer <token>``."""

    def __init__(self, app: ASGIApp, token: bytes) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            await _refuse(send, "missing bearer token (Authorization: Bearer <token>)")
            return
        if not hmac.compare_digest(given.strip(), self.token):
            await _refuse(send, "invalid bearer token")
            return
        await self.app(scope, receive, send)


def document_bearer(app: FastAPI) -> None:
    """Declare the bearer scheme on every ``/v1`` operation of ``app``'s OpenAPI document."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {})
        components.setdefault("securitySchemes", {})["bearer"] = {
            "type": "http",
            "scheme": "bearer",
        }
        for path, operations in schema.get("paths", {}).items():
            if path.startswith(PROTECTED_PREFIX):
                for operation in operations.values():
                    operation["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
