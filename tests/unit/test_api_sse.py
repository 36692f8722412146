"""SSE framing of engine events: ids, names, gaps, batching and closing the subscription."""

from __future__ import annotations

import json

import anyio

from api.sse import EventEncoder, sse_stream
from kvcache_offload.aio import EventHub, EventType, GapMarker
from kvcache_offload.base import OffloadKey
from kvcache_offload.client import parse_event

KEY = OffloadKey(b"\x01" * 8 + b"\0\0\0\0")


def _messages(chunk: bytes) -> list[dict[str, str]]:
    out = []
    for block in chunk.decode().split("\n\n"):
        if not block:
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        out.append(fields)
    return out


def test_event_frame_has_seq_as_id_type_as_name_and_json_data() -> None:
    hub = EventHub()
    event = hub.publish(EventType.STORED, [KEY], detail={"req_id": "r1"})
    (msg,) = _messages(EventEncoder().encode(event))
    assert msg["id"] == "1" and msg["event"] == "stored"
    data = json.loads(msg["data"])
    assert data == {
        "seq": 1,
        "timestamp": event.timestamp,
        "type": "stored",
        "keys": [KEY.hex()],
        "medium": "CPU",
        "detail": {"req_id": "r1"},
    }
    assert parse_event(msg["event"], data) == event


def test_gap_frame_lets_a_resume_continue_after_the_hole() -> None:
    (msg,) = _messages(EventEncoder().encode(GapMarker(missed=5, next_seq=11)))
    assert msg["event"] == "gap" and msg["id"] == "10"
    assert json.loads(msg["data"]) == {"missed": 5, "next_seq": 11}


def test_encoder_reuses_one_encoding_per_event() -> None:
    hub = EventHub()
    event = hub.publish(EventType.EVICTED, [KEY])
    encoder = EventEncoder(cache_size=2)
    assert encoder.encode(event) is encoder.encode(event)
    for _ in range(3):
        encoder.encode(hub.publish(EventType.STORED, [KEY]))
    assert len(encoder._cache) == 2


async def test_stream_batches_queued_events_in_order_and_closes_the_subscription() -> None:
    hub = EventHub()
    stream = sse_stream(lambda: hub.subscribe(), EventEncoder())
    first = anyio.Event()
    chunks: list[bytes] = []

    async def consume() -> None:
        async for chunk in stream:
            chunks.append(chunk)
            first.set()
            if sum(c.count(b"\n\n") for c in chunks) >= 101:
                break
        await stream.aclose()

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        with anyio.fail_after(5):
            while hub.subscribers == 0:
                await anyio.sleep(0.001)
        hub.publish(EventType.STORED, [KEY])
        await first.wait()
        for _ in range(100):
            hub.publish(EventType.STORED, [KEY])
    ids = [int(m["id"]) for c in chunks for m in _messages(c)]
    assert ids == list(range(1, 102))
    assert len(chunks) < 10  # queued events travel together
    assert hub.subscribers == 0


async def test_stream_that_never_started_holds_no_subscription() -> None:
    hub = EventHub()
    stream = sse_stream(lambda: hub.subscribe(), EventEncoder())
    await stream.aclose()
    assert hub.subscribers == 0
