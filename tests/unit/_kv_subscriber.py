"""A KV-event subscriber written from docs/kv-events.md alone (not from the publisher's code).

It declares the documented schema with msgspec, reads the PUB socket, and when a sequence
number jumps (or nothing arrives for a while: it may have joined late) asks the replay socket
for what it missed, so it ends up with every batch exactly once, in order.
"""

from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import zmq
import zmq.asyncio

Hash = int | bytes


def schema(array_like: bool) -> type[Any]:
    """The documented ``KVEventBatch`` type for one event encoding.

    (This module evaluates annotations eagerly, so the local classes resolve.)
    """

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[Hash]
        parent_block_hash: Hash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[Hash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return KVEventBatch


END = -1


class DocSubscriber:
    """SUB on the event endpoint plus DEALER replays; ``batches`` holds (seq, decoded batch)."""

    def __init__(
        self, endpoint: str, replay_endpoint: str, topic: str = "", encoding: str = "array"
    ) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.decoder = msgspec.msgpack.Decoder(schema(encoding == "array"))
        self.batches: list[tuple[int, Any]] = []
        self.live_seqs: list[int] = []
        self.replayed_seqs: list[int] = []
        self.next_seq = 0

    @property
    def events(self) -> list[Any]:
        return [event for _, batch in self.batches for event in batch.events]

    def _accept(self, seq: int, payload: bytes) -> None:
        if seq == self.next_seq:
            self.batches.append((seq, self.decoder.decode(payload)))
            self.next_seq += 1

    async def replay(self) -> None:
        """Ask for every batch from ``next_seq`` on; read until the end marker.

        A DEALER, not a REQ: a REQ socket can read only the first of the replies. The empty
        first frame is the envelope delimiter a REQ socket would have added.
        """
        req = self.ctx.socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        try:
            await req.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            while True:
                delimiter, seq_frame, payload = await req.recv_multipart()
                assert delimiter == b""
                seq = int.from_bytes(seq_frame, "big", signed=True)
                if seq == END:
                    assert payload == b""
                    return
                if seq == self.next_seq:
                    self.replayed_seqs.append(seq)
                self._accept(seq, payload)
        finally:
            req.close(linger=0)

    async def receive_once(self, timeout: float) -> bool:
        """One live message (repairing a gap first); False when none came within ``timeout``."""
        if not await self.sub.poll(int(timeout * 1000)):
            return False
        topic, seq_frame, payload = await self.sub.recv_multipart()
        assert topic == self.topic.encode()
        seq = int.from_bytes(seq_frame, "big")
        self.live_seqs.append(seq)
        if seq > self.next_seq:
            await self.replay()
        self._accept(seq, payload)
        return True

    async def collect(self, done: Callable[["DocSubscriber"], bool], timeout: float = 10.0) -> None:
        """Receive (replaying when idle) until ``done(self)``."""
        with anyio.fail_after(timeout):
            while not done(self):
                if not await self.receive_once(0.1):
                    await self.replay()

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()
