"""Server-sent-event framing of engine events: ``id:`` = ``<epoch>-<seq>``, ``event:`` = type.

The epoch names this run of sequence numbers (the engine's event hub makes a new one each
start), so a ``Last-Event-ID`` kept across a service restart is recognised as stale instead of
silently skipping the new run's events up to that number (see :func:`parse_event_id`).

Each event is encoded once, whatever the number of SSE streams reading it (``api/broadcast.py``).
A ``gap`` frame replaces events a subscriber missed; its ``id`` is the sequence number just
before the next event, so a client resuming with it as ``Last-Event-ID`` continues after the
hole. Heartbeats are SSE comments sent by sse-starlette.
"""

from __future__ import annotations

import re
from typing import Any

from kvcache_offload.aio.types import EngineEvent, GapMarker
from kvcache_offload.errors import ConfigError

from .responses import json_bytes

__all__ = ["GAP_EVENT", "EventEncoder", "event_payload", "parse_event_id"]

GAP_EVENT = "gap"

_EVENT_ID = re.compile(r"^(?:([0-9a-f]{1,32})-)?([0-9]{1,19})$")


def parse_event_id(raw: str) -> tuple[str | None, int]:
    """``"<epoch>-<seq>"`` (or a bare ``seq``, from older servers) as ``(epoch, seq)``."""
    match = _EVENT_ID.match(raw)
    if match is None:
        raise ConfigError(
            f"Last-Event-ID must be an event id such as '3f2a9c1e0b7d-42' (or a bare sequence "
            f"number), got {raw[:40]!r}"
        )
    return match.group(1), int(match.group(2))


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

    def __init__(self, cache_size: int = 8192, epoch: str = "0") -> None:
        self._cache: dict[int, bytes] = {}
        self._cache_size = cache_size
        self.epoch = epoch
        self._epoch = epoch.encode()

    def encode_all(self, items: list[EngineEvent | GapMarker]) -> list[bytes]:
        """Frames of ``items``, from the cache where it has them (a leading gap marker is
        the only kind of item without a sequence number)."""
        get, encode = self._cache.get, self.encode
        if items and isinstance(items[0], GapMarker):
            return [encode(items[0]), *self.encode_all(items[1:])]
        return [get(e.seq) or encode(e) for e in items]  # type: ignore[union-attr]

    def encode(self, item: EngineEvent | GapMarker) -> bytes:
        if isinstance(item, GapMarker):
            fields: dict[str, Any] = {"missed": item.missed, "next_seq": item.next_seq}
            if item.restarted:
                fields["restarted"] = True
            data = json_bytes(fields)
            return b"id: %s-%d\nevent: gap\ndata: %s\n\n" % (
                self._epoch,
                item.next_seq - 1,
                data,
            )
        cached = self._cache.get(item.seq)
        if cached is not None:
            return cached
        encoded = b"id: %s-%d\nevent: %s\ndata: %s\n\n" % (
            self._epoch,
            item.seq,
            item.type.value.encode(),
            json_bytes(event_payload(item)),
        )
        cache = self._cache
        if len(cache) >= self._cache_size:
            del cache[next(iter(cache))]  # insertion order is seq order: drop the oldest
        cache[item.seq] = encoded
        return encoded
