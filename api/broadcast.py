"""One engine subscription shared by every SSE client, through a ring of encoded frames.

With one engine subscription per client, each event costs a queue operation and a wake-up
per client in Python: at 20,000 events/s and 50 clients that is a million operations a
second, more than a core can do. Here a single pump task takes the engine's events, encodes
each once and appends it to a ring; a client only keeps a cursor into the ring, wakes once
per batch and sends everything new as one chunk (a C-level join). Per-event work is O(1);
per-client work is O(batches).

Memory per client is bounded: it holds a cursor and at most one chunk of
``_MAX_CHUNK_FRAMES`` frames in flight; a client that stops reading is disconnected after
``sse_send_timeout_s`` (sse-starlette's send timeout) and at most ``max_event_subscribers``
clients stream at once (more get 503).

A client that falls behind by more than the ring (``config.event_buffer_size`` events)
resumes at the oldest kept frame after a ``gap`` frame counting what it missed; a resume from
``Last-Event-ID`` starts right after that id, or with a gap when it left the ring.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import secrets
from collections.abc import AsyncIterator, Collection
from typing import Any

from api.sse import EventEncoder
from kvcache_offload.aio.types import EngineEvent, EngineStats, EventType, GapMarker

__all__ = ["EventBroadcaster"]

logger = logging.getLogger(__name__)

_MAX_CHUNK_FRAMES = 256
_MAX_CHUNK_BYTES = 64 * 1024
"""A chunk sent to a client holds at most this many frames and (beyond its first frame)
bytes: with a client that stops reading, one such chunk waits in the server's write
buffer, not thousands of frames."""


class EventBroadcaster:
    """Fans the engine's event stream out to any number of SSE clients."""

    def __init__(self, engine: Any, capacity: int, encoder: EventEncoder | None = None) -> None:
        self._engine = engine
        self._capacity = max(1, capacity)
        hub = getattr(engine, "event_hub", None)
        epoch = str(getattr(hub, "epoch", "")) or secrets.token_hex(6)
        self._encoder = encoder or EventEncoder(cache_size=1, epoch=epoch)
        # frames[i] has sequence number seqs[i] (a gap frame: next_seq - 1); base is the
        # absolute position of frames[0], so positions survive trimming.
        self._frames: list[bytes] = []
        self._seqs: list[int] = []
        self._types: list[str] = []
        self._base = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.subscribers = 0
        self.dropped = 0
        """Events clients missed because they fell behind or resumed too late."""

    # -- pump --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the pump (idempotent); it subscribes from seq 0 to mirror the engine's ring."""
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._pump(), name="sse-pump")

    async def aclose(self) -> None:
        """Stop the pump and end every client stream."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        self._notify()

    def end_streams(self) -> None:
        """End every client stream cleanly (server shutdown): each sends what it has, then
        finishes its response; the pump stops in :meth:`aclose`."""
        self._closed = True
        self._notify()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def epoch(self) -> str:
        """This run's event-id epoch: ids of another run are stale (``api/sse.py``)."""
        return self._encoder.epoch

    @property
    def engine(self) -> Any:
        return self._engine

    def adjust(self, stats: EngineStats) -> EngineStats:
        """Count SSE clients (not the pump) as subscribers, and what they missed as dropped."""
        if self.running:
            stats.event_subscribers += self.subscribers - 1
        stats.events_dropped += self.dropped
        return stats

    async def _pump(self) -> None:
        queue = max(self._capacity, 1024)
        subscription = self._engine.subscribe(None, since_seq=0, queue_size=queue)
        get_nowait = subscription.get_nowait
        try:
            async for item in subscription:
                self._append(item)
                while (more := get_nowait()) is not None:
                    self._append(more)
                self._notify()
        except Exception:
            logger.exception("the SSE event pump failed; SSE clients are disconnected")
        finally:
            await subscription.aclose()
            self._closed = True
            self._notify()

    def _append(self, item: EngineEvent | GapMarker) -> None:
        frame = self._encoder.encode(item)
        if isinstance(item, GapMarker):
            seq, kind = item.next_seq - 1, "gap"
        else:
            seq, kind = item.seq, item.type.value
        self._frames.append(frame)
        self._seqs.append(seq)
        self._types.append(kind)
        excess = len(self._frames) - 2 * self._capacity
        if excess > 0:  # trim in halves: amortised O(1) per frame
            cut = len(self._frames) - self._capacity
            del self._frames[:cut], self._seqs[:cut], self._types[:cut]
            self._base += cut

    def _notify(self) -> None:
        self._wakeup.set()
        self._wakeup = asyncio.Event()

    def _engine_last_seq(self) -> int:
        hub = getattr(self._engine, "event_hub", None)
        if hub is not None:
            return int(hub.last_seq)
        return int(self._engine.stats().last_event_seq)

    # -- clients -----------------------------------------------------------------------------

    def resume_point(self, epoch: str | None, seq: int) -> tuple[int, bool]:
        """Where a client resuming after ``epoch``/``seq`` starts, and whether it is stale.

        A stale id (another run's epoch, or a bare number this run never reached) resumes
        from the beginning of this run, after a ``gap`` frame with ``restarted``.
        """
        if (epoch is not None and epoch != self.epoch) or seq > self._engine_last_seq():
            return 0, True
        return seq, False

    async def stream(
        self,
        types: Collection[EventType] | None = None,
        since_seq: int | None = None,
        restarted: bool = False,
    ) -> AsyncIterator[bytes]:
        """SSE chunks for one client: live events, or every event after ``since_seq``."""
        self.start()
        wanted = None if types is None else frozenset(t.value for t in types) | {"gap"}
        last_seq = self._engine_last_seq() if since_seq is None else since_seq
        if restarted:
            first = self._seqs[0] if self._seqs else self._engine_last_seq() + 1
            yield self._encoder.encode(
                GapMarker(missed=first - 1 - last_seq, next_seq=first, restarted=True)
            )
            last_seq = first - 1
        position = self._base + bisect.bisect_right(self._seqs, last_seq)
        self.subscribers += 1
        try:
            while True:
                end = self._base + len(self._frames)
                if position >= end:
                    if self._closed:
                        return
                    await self._wakeup.wait()
                    continue
                start = max(position - self._base, 0)
                seqs = self._seqs
                if seqs[start] <= last_seq:  # frames the pump mirrored after we subscribed
                    start = bisect.bisect_right(seqs, last_seq, lo=start)
                    position = self._base + start
                    continue
                if start == 0 and seqs[0] > last_seq + 1 and self._types[0] != "gap":
                    missed = seqs[0] - last_seq - 1  # left the ring before we could send it
                    self.dropped += missed
                    yield self._encoder.encode(GapMarker(missed=missed, next_seq=seqs[0]))
                stop = min(end - self._base, start + _MAX_CHUNK_FRAMES)
                budget = _MAX_CHUNK_BYTES  # frames vary in size: cap the bytes too
                frames = self._frames
                for i in range(start, stop):
                    budget -= len(frames[i])
                    if budget < 0 and i > start:
                        stop = i
                        break
                position = self._base + stop
                last_seq = seqs[stop - 1]
                if wanted is None:
                    yield b"".join(self._frames[start:stop])
                else:
                    kinds, frames = self._types, self._frames
                    picked = [frames[i] for i in range(start, stop) if kinds[i] in wanted]
                    if picked:
                        yield b"".join(picked)
        finally:
            self.subscribers -= 1
