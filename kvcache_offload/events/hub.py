"""Event hub: a total order over engine events, fan-out to bounded subscribers, replay.

Every published event gets the next sequence number (1, 2, ...) and a Unix timestamp and is
kept in a ring buffer of the last ``buffer_size`` events. Each subscriber owns a bounded
anyio memory stream. The publisher never waits: when a subscriber's queue is full the event
is skipped *for that subscriber* and counted; once it catches up it receives exactly one
:class:`GapMarker` saying how many events it missed, then continues with live events.

A subscriber may resume from a sequence number: events with ``seq > since_seq`` still in the
ring are replayed first (preceded by a gap marker when some already fell out of the ring).
Gap counts cover the events a subscriber would have received: those of its types for a
subscriber that fell behind, all types for events that left the ring before a resume.

Readers that take events in batches (the SSE streams of the service) use an
:class:`EventCursor` instead: a position in the ring itself, with no queue, so such a reader
costs the publisher nothing per event. A cursor overtaken by the ring gets one gap marker for
the events that left it, then continues with the oldest kept event.

All methods run on the event-loop thread.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Collection, Sequence
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvcache_offload._closing import AsyncClosing
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError
from kvcache_offload.events.records import EngineEvent, EventType, GapMarker

__all__ = ["EventCursor", "EventHub", "EventSubscription"]

Item = EngineEvent | GapMarker


class EventSubscription(AsyncClosing):
    """Async iterator of :class:`EngineEvent` and :class:`GapMarker`; closing unsubscribes."""

    def __init__(
        self,
        hub: EventHub,
        types: frozenset[EventType] | None,
        queue_size: int,
        backlog: deque[Item],
    ) -> None:
        self._hub = hub
        self.types = types
        self.queue_size = queue_size
        self._backlog = backlog
        # One slot of slack so a gap marker always fits in front of the next event.
        send, recv = anyio.create_memory_object_stream[Item](queue_size + 1)
        self._send: MemoryObjectSendStream[Item] = send
        self._recv: MemoryObjectReceiveStream[Item] = recv
        self._missed = 0
        self._closed = False

    # -- publisher side (loop thread) --------------------------------------------------------

    def _offer(self, event: EngineEvent) -> None:
        if self._closed or (self.types is not None and event.type not in self.types):
            return
        if self._send.statistics().current_buffer_used >= self.queue_size:
            self._missed += 1
            self._hub._dropped += 1
            return
        if self._missed:
            self._send.send_nowait(GapMarker(missed=self._missed, next_seq=event.seq))
            self._missed = 0
        self._send.send_nowait(event)

    def _end(self) -> None:
        """Stop delivering new events; the consumer still drains what is queued."""
        self._send.close()

    # -- consumer side -----------------------------------------------------------------------

    @property
    def missed(self) -> int:
        """Events skipped since the last gap marker (not yet reported)."""
        return self._missed

    def get_nowait(self) -> Item | None:
        """The next queued item, or None if nothing is queued (raises nothing)."""
        if self._backlog:
            return self._backlog.popleft()
        try:
            return self._recv.receive_nowait()
        except anyio.WouldBlock:
            return self._pending_gap()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            return self._pending_gap()

    def _pending_gap(self) -> GapMarker | None:
        if not self._missed:
            return None
        gap = GapMarker(missed=self._missed, next_seq=self._hub.last_seq + 1)
        self._missed = 0
        return gap

    def __aiter__(self) -> EventSubscription:
        return self

    async def __anext__(self) -> Item:
        item = self.get_nowait()
        if item is not None:
            return item
        try:
            return await self._recv.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Unsubscribe (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._hub._remove(self)
        self._send.close()
        self._recv.close()


class EventCursor:
    """A reader's position in the hub's ring: :meth:`take` the events after it, in order.

    Counted among the hub's subscribers until closed; the events it lost to the ring count
    as dropped, like a subscriber's gaps.
    """

    def __init__(self, hub: EventHub, after_seq: int) -> None:
        self._hub = hub
        self.seq = after_seq
        """Sequence number of the last event taken (or skipped by a gap marker)."""
        self._closed = False
        hub._cursors += 1

    def take(self, limit: int) -> list[Item]:
        """Up to ``limit`` events after :attr:`seq`, first a gap marker if some left the ring."""
        hub = self._hub
        ring = hub._ring
        items: list[Item] = []
        first_kept = hub.oldest_seq
        lost = first_kept - 1 - self.seq
        if lost > 0:
            hub._dropped += lost
            items.append(GapMarker(missed=lost, next_seq=first_kept))
            self.seq = first_kept - 1
        start = self.seq - first_kept + 1
        stop = min(len(ring), start + limit)
        if start < stop:
            items.extend(ring[i] for i in range(start, stop))
            self.seq = ring[stop - 1].seq
        return items

    async def wait(self) -> bool:
        """Wait for an event after :attr:`seq` or a wake-up; False once the hub has closed
        and holds nothing newer."""
        hub = self._hub
        if hub._seq > self.seq:
            return True
        if hub._closed:
            return False
        if hub._readers_waiting is None:
            hub._readers_waiting = anyio.Event()
        await hub._readers_waiting.wait()
        return hub._seq > self.seq or not hub._closed

    def close(self) -> None:
        """Stop counting this reader (idempotent)."""
        if not self._closed:
            self._closed = True
            self._hub._cursors -= 1


_EVENT_SLOTS = tuple(
    getattr(EngineEvent, name).__set__
    for name in ("seq", "timestamp", "type", "keys", "medium", "detail")
)
_SET_SEQ, _SET_TIMESTAMP, _SET_TYPE, _SET_KEYS, _SET_MEDIUM, _SET_DETAIL = _EVENT_SLOTS
_object_new = object.__new__
_time = time.time


def _new_event(
    seq: int,
    timestamp: float,
    type: EventType,
    keys: list[OffloadKey],
    medium: str,
    detail: dict[str, Any],
) -> EngineEvent:
    """An :class:`EngineEvent` without its frozen ``__init__`` (one ``object.__setattr__``
    per field, 1.6 us): every event of a serving engine's jobs goes through here."""
    event = object.__new__(EngineEvent)
    _SET_SEQ(event, seq)
    _SET_TIMESTAMP(event, timestamp)
    _SET_TYPE(event, type)
    _SET_KEYS(event, keys)
    _SET_MEDIUM(event, medium)
    _SET_DETAIL(event, detail)
    return event


class EventHub:
    """Publishes engine events in one total order; never blocks on a subscriber."""

    def __init__(self, buffer_size: int = 10_000, queue_size: int = 1_000) -> None:
        if buffer_size < 1 or queue_size < 1:
            raise ConfigError(
                f"event buffer and queue sizes must be >= 1, got {buffer_size} and {queue_size}"
            )
        self.buffer_size = buffer_size
        self.queue_size = queue_size
        self._ring: deque[EngineEvent] = deque(maxlen=buffer_size)
        self._subs: dict[EventSubscription, None] = {}
        self._seq = 0
        self.epoch = secrets.token_hex(6)
        """Names this run of sequence numbers: a resume id from another run (a restart) is
        told apart from one of this run (see the SSE ids in ``api/sse.py``)."""
        self._published: dict[EventType, int] = {}
        self._dropped = 0
        self._closed = False
        self._cursors = 0
        self._readers_waiting: anyio.Event | None = None

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest event (0 before the first)."""
        return self._seq

    @property
    def oldest_seq(self) -> int:
        """Sequence number of the oldest event still in the ring (``last_seq + 1`` if none)."""
        return self._ring[0].seq if self._ring else self._seq + 1

    @property
    def subscribers(self) -> int:
        """Open subscriptions and cursors."""
        return len(self._subs) + self._cursors

    @property
    def published(self) -> dict[str, int]:
        """Events published so far, by type."""
        return {kind.value: n for kind, n in self._published.items()}

    @property
    def dropped(self) -> int:
        """Events subscribers missed (sum of all gap sizes)."""
        return self._dropped

    def publish(
        self,
        type: EventType,
        keys: Sequence[OffloadKey],
        *,
        medium: str = "CPU",
        detail: dict[str, Any] | None = None,
    ) -> EngineEvent:
        self._seq = seq = self._seq + 1
        # _new_event inline (every job publishes one to three events).
        event = _object_new(EngineEvent)
        _SET_SEQ(event, seq)
        _SET_TIMESTAMP(event, _time())
        _SET_TYPE(event, type)
        _SET_KEYS(event, list(keys))
        _SET_MEDIUM(event, medium)
        _SET_DETAIL(event, detail if detail is not None else {})
        self._ring.append(event)
        published = self._published
        published[type] = published.get(type, 0) + 1
        for sub in self._subs:
            sub._offer(event)
        if self._readers_waiting is not None:
            self.wake_readers()
        return event

    def wake_readers(self) -> None:
        """Return every pending :meth:`EventCursor.wait` (new events, closing, a shutdown)."""
        waiting, self._readers_waiting = self._readers_waiting, None
        if waiting is not None:
            waiting.set()

    def cursor(self, after_seq: int | None = None) -> EventCursor:
        """A cursor after ``after_seq`` (default: the newest event, so only new ones follow)."""
        if after_seq is not None and after_seq < 0:
            raise ConfigError(f"after_seq must be >= 0, got {after_seq}")
        return EventCursor(self, self._seq if after_seq is None else after_seq)

    def recent(self, since_seq: int = 0) -> list[EngineEvent]:
        """Events still in the ring with ``seq > since_seq``, oldest first."""
        ring = self._ring
        if not ring or since_seq >= ring[-1].seq:
            return []
        start = max(0, since_seq - ring[0].seq + 1)
        return [ring[i] for i in range(start, len(ring))]

    def subscribe(
        self,
        types: Collection[EventType | str] | None = None,
        since_seq: int | None = None,
        queue_size: int | None = None,
    ) -> EventSubscription:
        """A new subscription; with ``since_seq`` it first replays newer events from the ring."""
        size = self.queue_size if queue_size is None else queue_size
        if size < 1:
            raise ConfigError(f"queue_size must be >= 1, got {size}")
        wanted: frozenset[EventType] | None = None
        if types is not None:
            try:
                wanted = frozenset(EventType(t) for t in types)
            except ValueError as exc:
                raise ConfigError(
                    f"unknown event type in {sorted(map(str, types))}: expected some of "
                    f"{[t.value for t in EventType]}"
                ) from exc
        backlog: deque[Item] = deque()
        if since_seq is not None:
            if since_seq < 0:
                raise ConfigError(f"since_seq must be >= 0, got {since_seq}")
            first_kept = self._ring[0].seq if self._ring else self._seq + 1
            lost = min(first_kept, self._seq + 1) - since_seq - 1
            if lost > 0:
                backlog.append(GapMarker(missed=lost, next_seq=since_seq + lost + 1))
                self._dropped += lost
            backlog.extend(e for e in self.recent(since_seq) if wanted is None or e.type in wanted)
        sub = EventSubscription(self, wanted, size, backlog)
        if self._closed:
            sub._end()
        else:
            self._subs[sub] = None
        return sub

    def _remove(self, sub: EventSubscription) -> None:
        self._subs.pop(sub, None)

    def close(self) -> None:
        """End every subscription once it has drained what is queued; later ones end at once."""
        self._closed = True
        subs, self._subs = list(self._subs), {}
        for sub in subs:
            sub._end()
        self.wake_readers()
