"""``serve`` freezes its start-up heap out of the collector's reach and thaws it at shutdown."""

from __future__ import annotations

import gc
from typing import Any

from kvcache_offload_service.heap import FrozenStartupHeap


async def test_the_served_heap_is_frozen_after_startup_and_thawed_at_shutdown() -> None:
    sent: list[str] = []
    messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "lifespan.startup.complete"})
        assert gc.get_freeze_count() > 0  # what the app sees while serving
        await receive()
        await send({"type": "lifespan.shutdown.complete"})

    async def receive() -> dict[str, str]:
        return next(messages)

    async def send(message: dict[str, str]) -> None:
        sent.append(message["type"])

    heap = FrozenStartupHeap(app)
    try:
        await heap({"type": "lifespan"}, receive, send)
    finally:
        gc.unfreeze()
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert heap.frozen == 0 and gc.get_freeze_count() == 0
