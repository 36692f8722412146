"""``POST /v1/lookup`` served without the framework's per-request machinery.

Lookup is the call a scheduler makes for every request, so its overhead bounds the service's
rate. FastAPI's routing, request object and exception layers cost more than the lookup itself
(~70 us of ~130 us per call); this ASGI middleware answers that one route directly with the
same handler (``api.routes.keys.lookup_answer``) and the same error mapping
(``api.errors.error_response``). The FastAPI route stays as the documented fallback; auth,
body limits and metrics wrap both.
"""

from __future__ import annotations

from starlette.datastructures import State
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response
from .responses import json_bytes
from .routes.keys import LOOKUP_PATH, lookup_answer

__all__ = ["HotPathMiddleware", "HotRoute"]


class HotRoute:
    """Stands in for the matched route in ``scope["route"]`` (metrics read ``.path``)."""

    def __init__(self, path: str) -> None:
        self.path = path


_LOOKUP_ROUTE = HotRoute(LOOKUP_PATH)


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


class HotPathMiddleware:
    """Answers ``POST /v1/lookup`` itself; passes everything else on."""

    def __init__(self, app: ASGIApp, state: State) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != LOOKUP_PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        scope["route"] = _LOOKUP_ROUTE
        try:
            body = json_bytes(await lookup_answer(self.state, await _read_body(receive)))
        except Exception as exc:
            error = error_response(exc)
            if error is None:
                raise
            await error(scope, receive, send)
            return
        # The two ASGI messages a JSON response is, without building a Response object.
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
