"""Server-sent-event framing of engine events: ``id:`` = seq, ``event:`` = type, JSON data.

Each event is encoded once, whatever the number of subscribers (see ``api/broadcast.py``).
A ``gap`` frame replaces events a subscriber missed; its ``id`` is the sequence number just
before the next event, so a client resuming with it as ``Last-Event-ID`` continues after the
hole. Heartbeats are SSE comments sent by sse-starlette.
"""

from __future__ import annotations

from typing import Any

from api.responses import json_bytes
from kvcache_offload.aio.types import EngineEvent, GapMarker

__all__ = ["GAP_EVENT", "EventEncoder", "event_payload"]

GAP_EVENT = "gap"


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
