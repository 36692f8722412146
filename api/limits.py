"""Request limits: body bytes (413), body read time (408), keys (422) and token ids (413).

The body limits are a pure ASGI middleware so an oversized upload is refused from its
``Content-Length`` before a byte is read; bodies without one are counted as they stream in.
A client that does not deliver its whole body within ``body_read_timeout_s`` (one deadline
for the whole body, so trickling a byte now and then does not extend it) gets 408 instead of
holding a connection and a worker forever.

Large bodies (over ``LARGE_BODY_BYTES``, or of unknown length) are admitted
``max_large_bodies`` at a time, so the memory they take is bounded by about
``max_large_bodies x max_body_bytes`` (x2 while a body is joined) whatever the number of
clients; the others wait for their turn, up to ``body_read_timeout_s``, then get 503.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvcache_offload.errors import OffloadError

from .responses import send_json_error

__all__ = ["MAX_TOKEN_IDS", "BodyLimitMiddleware", "RequestLimitError", "check_key_count"]

MAX_TOKEN_IDS = 1 << 22
"""Token ids one request may send (4,194,304: four times a 1M-token context); more is 413.

It bounds the work and memory of deriving keys (32 MiB of int64 ids plus their packed copy)
whatever the block size, which ``max_keys_per_request`` alone does not: with
``block_size`` 1,048,576, 4096 keys stand for 4 billion ids."""

MAX_JSON_BODY_BYTES = MAX_TOKEN_IDS * 16 + 64 * 1024
"""JSON bodies (every POST) above this are 413 from ``Content-Length``, before a byte is read:
16 bytes per token id is room for the longest ids with spaces or pretty-printing."""


class RequestLimitError(OffloadError):
    """A request exceeds a configured limit; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check_key_count(count: int, limit: int) -> None:
    """Refuse requests naming more blocks than ``config.max_keys_per_request``."""
    if count > limit:
        raise RequestLimitError(
            422, f"request names {count} blocks, more than max_keys_per_request={limit}"
        )


async def _refuse(send: Send, limit: int, size: str, json_body: bool) -> None:
    if json_body:
        detail = (
            f"JSON request body of {size} bytes exceeds {limit} bytes (room for "
            f"{MAX_TOKEN_IDS:,} token ids, the most one request may send)"
        )
    else:
        detail = f"request body of {size} bytes exceeds max_body_bytes={limit}"
    await send_json_error(send, 413, "RequestTooLarge", detail, [(b"connection", b"close")])


LARGE_BODY_BYTES = 4 * 1024 * 1024
"""Bodies above this size count against ``max_large_bodies`` (64 hex keys are ~2 KiB)."""


class BodyLimitMiddleware:
    """Answer 413 to bodies larger than ``max_bytes``, 408 to bodies that stall mid-way."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        read_timeout_s: float = 30.0,
        max_large_bodies: int = 2,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_json_bytes = min(max_bytes, MAX_JSON_BODY_BYTES)
        self.read_timeout_s = read_timeout_s
        self._large = asyncio.Semaphore(max_large_bodies)
        self.max_large_bodies = max_large_bodies

    def _timed(self, receive: Receive) -> Receive:
        """``receive`` with one deadline for the whole body, counted from the first read.

        Later calls (a streaming response waiting for the client to disconnect) wait freely.
        """
        complete = False
        timeout_s = self.read_timeout_s
        deadline: float | None = None

        async def timed_receive() -> Message:
            nonlocal complete, deadline
            if complete:
                return await receive()
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestLimitError(
                    408, f"request body not received within {timeout_s:g} s"
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            return message

        return timed_receive

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        receive = self._timed(receive)
        # Every POST takes JSON (at most MAX_JSON_BODY_BYTES); PUT takes blocks.
        json_body = scope.get("method") == "POST" and self.max_json_bytes < self.max_bytes
        limit = self.max_json_bytes if json_body else self.max_bytes
        length: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
                break
        if length is not None:
            if not length.isdigit() or int(length) > limit:
                await _refuse(send, limit, length.decode("latin-1")[:32], json_body)
                return
            if int(length) <= LARGE_BODY_BYTES:
                await self.app(scope, receive, send)  # the server enforces the length
                return
        elif scope.get("method") in ("GET", "HEAD"):
            await self._counted(scope, receive, send, limit)
            return
        try:
            async with asyncio.timeout(self.read_timeout_s):
                await self._large.acquire()
        except TimeoutError:
            detail = (
                f"{self.max_large_bodies} large request bodies are being received already "
                f"(max_large_bodies); retry shortly"
            )
            await send_json_error(send, 503, "Busy", detail, [(b"retry-after", b"1")])
            return
        try:
            if length is not None:
                await self.app(scope, receive, send)
            else:
                await self._counted(scope, receive, send, limit)
        finally:
            self._large.release()

    async def _counted(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        seen = 0
        over = False
        started = False

        async def limited_receive() -> Message:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over and not started:
                return
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not over or started:
                raise
        if over and not started:
            await _refuse(send, limit, f"more than {limit}", json_body=limit < self.max_bytes)
