"""Fast JSON encoding for responses and SSE payloads (orjson when installed, else json)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from starlette.responses import Response
from starlette.types import Send

__all__ = ["FastJSONResponse", "json_bytes", "send_json_error"]

try:
    import orjson

    def json_bytes(content: Any) -> bytes:
        """Encode ``content`` as compact UTF-8 JSON."""
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)

except ImportError:  # pragma: no cover - orjson is in the server extra

    def json_bytes(content: Any) -> bytes:
        """Encode ``content`` as compact UTF-8 JSON."""
        return json.dumps(content, separators=(",", ":"), ensure_ascii=False).encode()


class FastJSONResponse(Response):
    """A JSON response rendered without FastAPI's generic encoder."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


async def send_json_error(
    send: Send,
    status: int,
    error: str,
    detail: str,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """Answer ``{"error", "detail"}`` from a pure ASGI middleware, before any route runs."""
    body = json_bytes({"error": error, "detail": detail})
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
