"""KVEventPublisher: the engine's block events on a ZMQ PUB socket in vLLM's wire format.

It subscribes to the engine's :class:`EventHub` for stored, evicted and reset events and, in
one task on the event loop, turns everything queued since it last ran (one loop tick) into one
``KVEventBatch`` (see :mod:`kvcache_offload.kv_events.wire`), sent as
``[topic, seq (8 bytes, big-endian), payload]`` with ``seq`` counting batches from 0. It never
waits for a subscriber: a PUB socket drops what a slow or absent subscriber cannot take, so
such a subscriber costs one non-blocking send per batch. A subscriber that notices a gap in
``seq`` asks the ROUTER replay socket (if configured) for the batches it missed: the last
``replay_batches`` batches are kept, at least the SSE ring's depth (``event_buffer_size``).

Endpoints follow vLLM's convention: a PUB endpoint containing ``*`` or ``::`` or using
``ipc://`` / ``inproc://`` is bound, any other is connected to; the replay endpoint is bound.
Should the hub's queue ever overflow, the missed events are recovered from the hub's ring;
events no longer there are counted in ``events_lost``.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import zmq

from kvcache_offload.errors import ConfigError, OffloadError
from kvcache_offload.events.hub import EventHub
from kvcache_offload.events.records import EngineEvent, GapMarker
from kvcache_offload.kv_events.block_tokens import BlockTokens
from kvcache_offload.kv_events.stats import KVEventStats
from kvcache_offload.kv_events.translate import PUBLISHED_TYPES, EventTranslator
from kvcache_offload.kv_events.wire import END_SEQ, Encoding, HashFormat, WireCodec

__all__ = ["KVEventPublisher"]

logger = logging.getLogger(__name__)

MAX_EVENTS_PER_BATCH = 4096
"""Engine events folded into one batch at most (a long backlog becomes several batches)."""
_QUEUE_FLOOR = 65_536
"""Hub queue of the publisher's subscription, at least: a burst within one tick fits."""
_REPLAY_YIELD_EVERY = 256
"""Replayed messages between two yields to the event loop."""


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes the hub's block events over ZMQ; ``run`` in a task, ``aclose`` at the end."""

    def __init__(
        self,
        hub: EventHub,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        encoding: Encoding = "array",
        hash_format: HashFormat = "int",
        block_sizes: Sequence[int] = (16,),
        media: Mapping[str, str] | None = None,
        replay_batches: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        linger_ms: int = 500,
    ) -> None:
        if replay_batches < 1:
            raise ConfigError(f"replay_batches must be >= 1, got {replay_batches}")
        self.topic = topic
        self._topic = topic.encode()
        self.codec = WireCodec(encoding, data_parallel_rank)
        self.tokens = BlockTokens()
        self._translator = EventTranslator(
            self.codec,
            hash_format=hash_format,
            block_sizes=block_sizes,
            media=media,
            tokens=self.tokens,
        )
        self._hub = hub
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)
        self._next_seq = 0
        self._last_hub_seq = hub.last_seq
        self._batches = self._events = self._lost = 0
        self._replay_requests = self._replayed = 0
        self._closed = False
        self._ctx = zmq.Context()
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, linger_ms)
            if _binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            self.endpoint = self._last_endpoint(self._pub, endpoint)
            self.replay_endpoint: str | None = None
            if replay_endpoint:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, linger_ms)
                # A full replay (every batch plus the end marker) fits in one peer's pipe.
                self._router.setsockopt(zmq.SNDHWM, replay_batches + 1)
                self._router.bind(replay_endpoint)
                self.replay_endpoint = self._last_endpoint(self._router, replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            self._ctx.term()
            where = (
                repr(endpoint) if replay_endpoint is None else f"{endpoint!r}, {replay_endpoint!r}"
            )
            raise ConfigError(f"cannot open the KV-event sockets ({where}): {exc}") from None
        self._sub = hub.subscribe(PUBLISHED_TYPES, queue_size=max(_QUEUE_FLOOR, hub.buffer_size))

    @staticmethod
    def _last_endpoint(sock: zmq.Socket[bytes], given: str) -> str:
        """The bound address (a ``*`` port resolved), or ``given`` for a connect."""
        try:
            last = sock.getsockopt(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            return given
        return last.decode() if isinstance(last, bytes) and last else given

    # -- the publishing task -------------------------------------------------------------------

    async def run(self) -> None:
        """Forward hub events until cancelled; serves replay requests meanwhile."""
        try:
            async with anyio.create_task_group() as tg:
                if self._router is not None:
                    tg.start_soon(self._serve_replay, name="kvcache-offload-kv-events-replay")
                async for item in self._sub:
                    items: list[EngineEvent | GapMarker] = [item]
                    while len(items) < MAX_EVENTS_PER_BATCH:
                        more = self._sub.get_nowait()
                        if more is None:
                            break
                        items.append(more)
                    self._publish(items)
                tg.cancel_scope.cancel()
        finally:
            self.flush()

    def flush(self) -> None:
        """Publish whatever the hub queued and the task has not read yet (synchronous)."""
        if self._pub is None:
            return
        while True:
            items: list[EngineEvent | GapMarker] = []
            while len(items) < MAX_EVENTS_PER_BATCH:
                item = self._sub.get_nowait()
                if item is None:
                    break
                items.append(item)
            if not items:
                return
            self._publish(items)

    def _publish(self, items: list[EngineEvent | GapMarker]) -> None:
        wire: list[Any] = []
        for item in items:
            if isinstance(item, GapMarker):
                wire.extend(self._recover(item))
                continue
            self._last_hub_seq = item.seq
            wire.extend(self._translator.translate(item))
        if wire:
            self.send_batch(wire)

    def _recover(self, gap: GapMarker) -> list[Any]:
        """Re-read events the subscription skipped from the hub's ring; count the rest lost."""
        found = 0
        recovered: list[Any] = []
        for event in self._hub.recent(self._last_hub_seq):
            if event.seq >= gap.next_seq:
                break
            if event.type in PUBLISHED_TYPES:
                found += 1
                recovered.extend(self._translator.translate(event))
        lost = max(0, gap.missed - found)
        if lost:
            self._lost += lost
            logger.warning("%d engine events were lost before the KV-event publisher", lost)
        self._last_hub_seq = gap.next_seq - 1
        return recovered

    def send_batch(self, events: Sequence[Any], ts: float | None = None) -> int:
        """Encode, send and keep one batch; returns its sequence number."""
        if self._pub is None:
            raise OffloadError("the KV-event publisher is closed")
        payload = self.codec.encode_batch(events, ts)
        seq = self._next_seq
        self._next_seq += 1
        # PUB never blocks: a subscriber whose pipe is full misses the message (and replays it).
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(
                (self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
            )
        self._buffer.append((seq, payload))
        self._batches += 1
        self._events += len(events)
        return seq

    # -- replay -----------------------------------------------------------------------------

    async def _serve_replay(self) -> None:
        """Answer requests as they come; ZMQ's descriptor only says "look at EVENTS"."""
        router = self._router
        if router is None:
            return
        fd = int(router.getsockopt(zmq.FD))
        while True:
            while int(router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                await self._answer(router, router.recv_multipart(zmq.NOBLOCK))
            await anyio.wait_readable(fd)

    async def _answer(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """Batches with ``seq >= start`` then the end marker, to a REQ (3 frames) or DEALER."""
        if len(frames) not in (2, 3) or (len(frames) == 3 and frames[1]):
            logger.warning("ignored a malformed KV-event replay request (%d frames)", len(frames))
            return
        head = (frames[0], b"") if len(frames) == 3 else (frames[0],)
        self._replay_requests += 1
        start_bytes = frames[-1]
        if len(start_bytes) == 8:
            start = int.from_bytes(start_bytes, "big")
            batches = [(s, p) for s, p in self._buffer if s >= start]
            for i, (seq, payload) in enumerate(batches, 1):
                router.send_multipart((*head, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
                self._replayed += 1
                if i % _REPLAY_YIELD_EVERY == 0:
                    await anyio.sleep(0)
        else:
            logger.warning("KV-event replay request of %d bytes, expected 8", len(start_bytes))
        router.send_multipart((*head, END_SEQ, b""), zmq.NOBLOCK)

    # -- state ------------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """Sequence number the next batch will get."""
        return self._next_seq

    @property
    def buffered(self) -> list[tuple[int, bytes]]:
        """The replay buffer: (seq, payload) of the newest batches, oldest first."""
        return list(self._buffer)

    def stats(self) -> KVEventStats:
        return KVEventStats(
            batches_published=self._batches,
            events_published=self._events,
            replay_requests=self._replay_requests,
            batches_replayed=self._replayed,
            events_lost=self._lost,
        )

    def remember_tokens(
        self, keys: Sequence[Any], token_ids: Sequence[int], block_size: int
    ) -> None:
        """Tell the publisher which tokens ``keys`` (derived from ``token_ids``) stand for."""
        self.tokens.remember(keys, token_ids, block_size)

    def remember_token_blocks(
        self, keys: Sequence[Any], blocks: Sequence[tuple[int, ...]], block_size: int
    ) -> None:
        """The same with the blocks already made by
        :func:`~kvcache_offload.kv_events.block_tokens.token_blocks` (e.g. in a worker thread)."""
        self.tokens.remember_blocks(keys, blocks, block_size)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close()
        self._pub = self._router = None

    async def aclose(self) -> None:
        """Publish what is queued, close the sockets, then end the ZMQ context off-loop.

        The context waits up to ``linger_ms`` for queued messages to leave.
        """
        if self._closed:
            return
        self._closed = True
        self.flush()
        self._sub.close()
        self._close_sockets()
        await anyio.to_thread.run_sync(self._ctx.term)
