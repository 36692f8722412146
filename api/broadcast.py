"""SSE streams read straight from the engine's event hub: its ring, its sequence numbers.

Each client holds an :class:`~kvcache_offload.events.hub.EventCursor` (a position in the
hub's ring, no queue), wakes once per burst of events and sends what is new as one chunk (a
C-level join of frames the encoder made once for all clients; clients reading in step share
the joined chunk itself). Per-event work in the publisher is O(1) whatever the number of
clients.

Memory per client is bounded: a cursor and one chunk of at most ``_MAX_CHUNK_FRAMES`` frames
and (beyond its first frame) ``_MAX_CHUNK_BYTES`` bytes in flight; a client that stops
reading is disconnected after ``sse_send_timeout_s`` (sse-starlette's send timeout) and at
most ``max_event_subscribers`` clients stream at once (more get 503).

A client overtaken by the ring (``config.event_buffer_size`` events) gets a ``gap`` frame
counting what it missed, then the oldest kept event; a resume from ``Last-Event-ID`` starts
right after that id, or with a gap when it left the ring. Ids carry the hub's epoch: an id of
another run is stale and replays this run from its start after a ``restarted`` gap frame.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Iterator

from kvcache_offload.aio.types import EngineEvent, EventType, GapMarker
from kvcache_offload.events.hub import EventHub

from .sse import EventEncoder

__all__ = ["EventBroadcaster"]

_MAX_CHUNK_FRAMES = 256
_MAX_CHUNK_BYTES = 64 * 1024
"""A chunk sent to a client holds at most this many frames and (beyond its first frame)
bytes: with a client that stops reading, one such chunk waits in the server's write
buffer, not thousands of frames."""


class EventBroadcaster:
    """The SSE streams of one event hub; counts them for ``max_event_subscribers``."""

    def __init__(self, hub: EventHub, encoder: EventEncoder | None = None) -> None:
        self.hub = hub
        self._encoder = encoder or EventEncoder(cache_size=2 * _MAX_CHUNK_FRAMES, epoch=hub.epoch)
        self._end_seq: int | None = None
        """Set by :meth:`end_streams`: the last event streams still send."""
        self.subscribers = 0
        """SSE streams open now."""
        self._shared: tuple[int, int, list[bytes]] = (0, 0, [])
        """The last batch a stream framed: (after seq, last seq, chunks). Streams reading in
        step (the usual case) send it as it is, so per-stream work is O(1) per batch."""

    @property
    def epoch(self) -> str:
        """This run's event-id epoch (the hub's): ids of another run are stale."""
        return self._encoder.epoch

    def end_streams(self) -> None:
        """End every stream cleanly (server shutdown): each sends the events published so
        far, then ends."""
        self._end_seq = self.hub.last_seq
        self.hub.wake_readers()

    def resume_point(self, epoch: str | None, seq: int) -> tuple[int, bool]:
        """Where a client resuming after ``epoch``/``seq`` starts, and whether it is stale.

        A stale id (another run's epoch, or a bare number this run never reached) resumes
        from the beginning of this run, after a ``gap`` frame with ``restarted``.
        """
        if (epoch is not None and epoch != self.epoch) or seq > self.hub.last_seq:
            return 0, True
        return seq, False

    async def stream(
        self,
        types: Collection[EventType] | None = None,
        since_seq: int | None = None,
        restarted: bool = False,
    ) -> AsyncIterator[bytes]:
        """SSE chunks for one client: live events, or every event after ``since_seq``."""
        wanted = None if types is None else frozenset(types)
        cursor = self.hub.cursor(since_seq)
        self.subscribers += 1
        try:
            if restarted:
                first = self.hub.oldest_seq
                yield self._encoder.encode(
                    GapMarker(missed=first - 1, next_seq=first, restarted=True)
                )
                cursor.seq = first - 1
            while True:
                end = self._end_seq
                shared = self._shared
                if wanted is None and end is None and shared[0] == cursor.seq < shared[1]:
                    cursor.seq = shared[1]  # another stream already framed this batch
                    for chunk in shared[2]:
                        yield chunk
                    continue
                items = cursor.take(_MAX_CHUNK_FRAMES)
                if end is not None:  # shutting down: what was published before, then stop
                    items = [i for i in items if isinstance(i, GapMarker) or i.seq <= end]
                if not items:
                    if end is not None or not await cursor.wait():
                        return
                    continue
                chunks = list(self._chunks(items, wanted))
                head = items[0]
                if wanted is None and isinstance(head, EngineEvent):
                    self._shared = (head.seq - 1, cursor.seq, chunks)
                for chunk in chunks:
                    yield chunk
        finally:
            self.subscribers -= 1
            cursor.close()

    def _chunks(
        self, items: list[EngineEvent | GapMarker], wanted: frozenset[EventType] | None
    ) -> Iterator[bytes]:
        """The wanted ``items`` as chunks of at most ``_MAX_CHUNK_BYTES`` beyond a first frame."""
        if wanted is not None:
            items = [i for i in items if isinstance(i, GapMarker) or i.type in wanted]
        frames = self._encoder.encode_all(items)
        if sum(map(len, frames)) <= _MAX_CHUNK_BYTES:  # the usual case: one C-level join
            if frames:
                yield b"".join(frames)
            return
        start, budget = 0, _MAX_CHUNK_BYTES
        for i, frame in enumerate(frames):
            if i > start and len(frame) > budget:
                yield b"".join(frames[start:i])
                start, budget = i, _MAX_CHUNK_BYTES
            budget -= len(frame)
        yield b"".join(frames[start:])
