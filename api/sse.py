"""Server-sent-event framing of engine events: ``id:`` = seq, ``event:`` = type, JSON data.

Each event is encoded once and shared by every subscriber (a small cache keyed by sequence
number), and a subscriber's queued events go out as one chunk: with many subscribers and a
busy engine, per-event writes and per-subscriber encoding would dominate the server's time.
A subscriber that fell behind gets an explicit ``gap`` event whose ``id`` lets it resume
after the hole; heartbeats are SSE comments sent by sse-starlette.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from api.responses import json_bytes
from kvcache_offload.aio.types import EngineEvent, GapMarker

__all__ = ["GAP_EVENT", "EventEncoder", "event_payload", "sse_stream"]

GAP_EVENT = "gap"
_MAX_CHUNK_EVENTS = 512


def event_payload(event: EngineEvent) -> dict[str, Any]:
    """The JSON ``data`` of one event (keys as hex)."""
    return {
        "seq": event.seq,
        "timestamp": event.timestamp,
        "type": event.type.value,
        "keys": [k.hex() for k in event.keys],
        "medium": event.medium,
        "detail": event.detail,
    }


class EventEncoder:
    """Encodes events to SSE bytes once, whatever the number of subscribers."""

    def __init__(self, cache_size: int = 8192) -> None:
        self._cache: dict[int, bytes] = {}
        self._cache_size = cache_size

    def encode(self, item: EngineEvent | GapMarker) -> bytes:
        if isinstance(item, GapMarker):
            data = json_bytes({"missed": item.missed, "next_seq": item.next_seq})
            return b"id: %d\nevent: gap\ndata: %s\n\n" % (item.next_seq - 1, data)
        cached = self._cache.get(item.seq)
        if cached is not None:
            return cached
        encoded = b"id: %d\nevent: %s\ndata: %s\n\n" % (
            item.seq,
            item.type.value.encode(),
            json_bytes(event_payload(item)),
        )
        cache = self._cache
        if len(cache) >= self._cache_size:
            del cache[next(iter(cache))]  # insertion order is seq order: drop the oldest
        cache[item.seq] = encoded
        return encoded


async def sse_stream(subscribe: Callable[[], Any], encoder: EventEncoder) -> AsyncIterator[bytes]:
    """SSE chunks from a new engine subscription; closes it when the client goes away.

    Subscribing happens inside the generator, so a stream that never starts holds nothing.
    """
    subscription = subscribe()
    get_nowait = getattr(subscription, "get_nowait", None)
    try:
        async for item in subscription:
            chunks = [encoder.encode(item)]
            if get_nowait is not None:
                while len(chunks) < _MAX_CHUNK_EVENTS:
                    more = get_nowait()
                    if more is None:
                        break
                    chunks.append(encoder.encode(more))
            yield b"".join(chunks)
    finally:
        await subscription.aclose()
