"""Abusive requests cost bounded resources: off-loop parsing, large-body admission."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from kvcache_offload_service.limits import LARGE_BODY_BYTES, BodyLimitMiddleware
from kvcache_offload_service.routes import _keys
from tests.unit._api_app import served


async def test_large_token_id_bodies_are_parsed_and_hashed_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads: list[threading.Thread] = []
    resolve = _keys.resolve_keys

    def spy(*args: Any) -> Any:
        threads.append(threading.current_thread())
        return resolve(*args)

    monkeypatch.setattr(_keys, "resolve_keys", spy)
    async with served() as s:
        big = {"token_ids": list(range(100_000)), "block_size": 1_048_576}
        r = await s.client.post("/v1/lookup", json=big)
        assert r.status_code == 200, r.text
        assert threads[-1] is not threading.main_thread()  # the loop stayed free
        r = await s.client.post("/v1/lookup", json={"keys": []})
        assert threads[-1] is threading.main_thread()  # small bodies stay on the loop


async def test_large_bodies_are_admitted_a_few_at_a_time() -> None:
    """With max_large_bodies=1, a second large upload waits for the first, then 503s."""
    first_entered = asyncio.Event()
    release = asyncio.Event()
    entered: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        entered.append(scope["path"])
        if scope["path"] == "/one":
            first_entered.set()
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = BodyLimitMiddleware(app, max_bytes=1 << 30, read_timeout_s=0.2, max_large_bodies=1)
    large = str(LARGE_BODY_BYTES + 1).encode()

    def scope(path: str, length: bytes) -> dict[str, Any]:
        return {"type": "http", "method": "PUT", "path": path,
                "headers": [(b"content-length", length)]}  # fmt: skip

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    one = asyncio.create_task(middleware(scope("/one", large), receive, send))
    await first_entered.wait()
    await middleware(scope("/two", large), receive, send)  # waits 0.2 s, then gives up
    assert entered == ["/one"]
    assert sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"] == "Busy"
    await middleware(scope("/small", b"10"), receive, send)  # small bodies never wait
    assert entered == ["/one", "/small"]
    release.set()
    await one


async def test_event_streams_beyond_max_event_subscribers_answer_503() -> None:
    from kvcache_offload_service.broadcast import EventBroadcaster
    from tests.unit._api_app import small_config

    async with served(small_config(max_event_subscribers=1)) as s:
        broadcaster = EventBroadcaster(s.engine.event_hub)
        s.app.state.broadcaster = broadcaster
        broadcaster.subscribers = 1  # one stream is open
        r = await s.client.get("/v1/events")
        assert r.status_code == 503
        assert r.json()["error"] == "TooManySubscribers"
        assert "max_event_subscribers=1" in r.json()["detail"]
