"""Optional bearer token on every ``/v1`` route, compared in constant time."""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException
from starlette.requests import Request

__all__ = ["require_token"]

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kvcache-offload"'}


def require_token(request: Request) -> None:
    """FastAPI dependency: pass when no token is configured or the request carries it."""
    expected: bytes | None = request.app.state.api_token
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise HTTPException(401, "missing bearer token (Authorization: Bearer <token>)", _CHALLENGE)
    if not hmac.compare_digest(given.strip().encode(), expected):
        raise HTTPException(401, "invalid bearer token", _CHALLENGE)
