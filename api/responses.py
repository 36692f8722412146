"""Fast JSON encoding for responses and SSE payloads (orjson when installed, else json)."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

__all__ = ["FastJSONResponse", "json_bytes"]

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
