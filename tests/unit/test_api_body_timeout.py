"""A client that stops sending its body mid-way gets 408, not a connection held forever."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvcache_offload.aio import OffloadEngine
from kvcache_offload_service import create_app
from tests.unit._api_app import small_config


async def _call(app: Any, scope: dict[str, Any], chunks: list[bytes], stall: bool) -> list[Any]:
    queue = list(chunks)
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        if queue:
            body = queue.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(queue) or stall}
        await asyncio.Event().wait()  # the client went silent
        raise AssertionError("unreachable")

    async def send(message: Any) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


def _scope(path: str, method: str = "POST") -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }


async def test_stalled_bodies_answer_408_on_the_hot_path_and_on_routes() -> None:
    async with OffloadEngine(small_config(body_read_timeout_s=0.05)) as engine:
        app = create_app(engine)
        for path in ("/v1/lookup", "/v1/store/prepare"):
            sent = await _call(app, _scope(path), [b'{"keys": ['], stall=True)
            start = next(m for m in sent if m["type"] == "http.response.start")
            assert start["status"] == 408, path
            body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
            assert json.loads(body)["error"] == "RequestTimeout"
        assert engine.stats().blocks_writing == 0  # nothing was prepared


async def test_a_complete_body_in_chunks_is_not_cut_off() -> None:
    async with OffloadEngine(small_config(body_read_timeout_s=0.05)) as engine:
        app = create_app(engine)
        key = (1).to_bytes(8, "big").hex() + "00000000"
        sent = await _call(
            app, _scope("/v1/lookup"), [b'{"keys": ', f'["{key}"]}}'.encode()], stall=False
        )
        start = next(m for m in sent if m["type"] == "http.response.start")
        assert start["status"] == 200


async def test_a_body_trickled_byte_by_byte_still_hits_one_deadline_for_the_whole_body() -> None:
    """Each chunk arrives well within the timeout; the whole body does not."""
    async with OffloadEngine(small_config(body_read_timeout_s=0.3)) as engine:
        app = create_app(engine)
        sent: list[Any] = []

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(0.05)  # a byte every 50 ms: each chunk is "on time"
            return {"type": "http.request", "body": b" ", "more_body": True}

        async def send(message: Any) -> None:
            sent.append(message)

        await asyncio.wait_for(app(_scope("/v1/lookup"), receive, send), timeout=10)
        start = next(m for m in sent if m["type"] == "http.response.start")
        assert start["status"] == 408
