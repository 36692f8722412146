"""SSE framing of engine events and the streams over the hub's ring: order, resume, gaps,
filters, closing."""

from __future__ import annotations

import asyncio
import json

import anyio
import pytest

from kvcache_offload.aio import EventHub, EventType, GapMarker, OffloadEngine
from kvcache_offload.client import parse_event
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError
from kvcache_offload_service.broadcast import EventBroadcaster
from kvcache_offload_service.sse import EventEncoder, parse_event_id
from tests.unit._api_app import small_config

KEY = OffloadKey(b"\x01" * 8 + b"\0\0\0\0")


def _seq(msg: dict[str, str]) -> int:
    """The sequence number of an SSE id ``<epoch>-<seq>``."""
    return int(msg["id"].rsplit("-", 1)[1])


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
    (msg,) = _messages(EventEncoder(epoch="ab12").encode(event))
    assert msg["id"] == "ab12-1" and msg["event"] == "stored"
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
    (msg,) = _messages(EventEncoder(epoch="ab12").encode(GapMarker(missed=5, next_seq=11)))
    assert msg["event"] == "gap" and msg["id"] == "ab12-10"
    assert json.loads(msg["data"]) == {"missed": 5, "next_seq": 11}


def test_encoder_reuses_one_encoding_per_event() -> None:
    hub = EventHub()
    event = hub.publish(EventType.EVICTED, [KEY])
    encoder = EventEncoder(cache_size=2)
    assert encoder.encode(event) is encoder.encode(event)
    for _ in range(3):
        encoder.encode(hub.publish(EventType.STORED, [KEY]))
    assert len(encoder._cache) == 2


async def _read(stream, count: int) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    if count <= 0:
        return messages
    with anyio.fail_after(5):
        async for chunk in stream:
            messages.extend(_messages(chunk))
            if len(messages) >= count:
                break
    return messages


async def test_live_clients_get_every_new_event_in_order_in_few_chunks() -> None:
    async with OffloadEngine(small_config()) as engine:
        hub = engine.event_hub
        hub.publish(EventType.STORED, [KEY])  # before the client: not sent to it
        broadcaster = EventBroadcaster(engine.event_hub)
        streams = [broadcaster.stream() for _ in range(3)]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await asyncio.sleep(0)  # let the clients register their starting point
        for _ in range(200):
            hub.publish(EventType.STORED, [KEY])
        chunks = [await f for f in firsts]
        for stream, chunk in zip(streams, chunks, strict=True):
            messages = _messages(chunk) + await _read(stream, 200 - len(_messages(chunk)))
            assert [_seq(m) for m in messages] == list(range(2, 202))
            await stream.aclose()
        assert broadcaster.subscribers == 0
        broadcaster.end_streams()


async def test_resume_replays_exactly_the_events_after_since_seq() -> None:
    async with OffloadEngine(small_config()) as engine:
        for _ in range(10):
            engine.event_hub.publish(EventType.STORED, [KEY])
        broadcaster = EventBroadcaster(engine.event_hub)
        stream = broadcaster.stream(since_seq=6)
        assert [_seq(m) for m in await _read(stream, 4)] == [7, 8, 9, 10]
        await stream.aclose()
        broadcaster.end_streams()


async def test_resume_older_than_the_ring_starts_with_a_gap() -> None:
    async with OffloadEngine(small_config(event_buffer_size=10)) as engine:
        broadcaster = EventBroadcaster(engine.event_hub)
        for _ in range(50):
            engine.event_hub.publish(EventType.STORED, [KEY])
        oldest = engine.event_hub.oldest_seq
        stream = broadcaster.stream(since_seq=3)
        gap, first = (await _read(stream, 2))[:2]
        assert gap["event"] == "gap" and json.loads(gap["data"]) == {
            "missed": oldest - 4,
            "next_seq": oldest,
        }
        assert _seq(first) == oldest
        assert engine.stats().events_dropped >= oldest - 4
        await stream.aclose()
        broadcaster.end_streams()


async def test_a_client_that_falls_behind_gets_a_gap_then_continues() -> None:
    async with OffloadEngine(small_config(event_buffer_size=10)) as engine:
        broadcaster = EventBroadcaster(engine.event_hub)
        stream = broadcaster.stream()
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        engine.event_hub.publish(EventType.STORED, [KEY])
        assert [_seq(m) for m in _messages(await first)] == [1]
        for _ in range(100):  # the client reads nothing meanwhile
            engine.event_hub.publish(EventType.STORED, [KEY])
        messages = await _read(stream, 2)
        assert messages[0]["event"] == "gap"
        gap = json.loads(messages[0]["data"])
        assert _seq(messages[1]) == gap["next_seq"] == engine.event_hub.oldest_seq
        assert gap["missed"] == gap["next_seq"] - 2
        await stream.aclose()
        broadcaster.end_streams()


async def test_type_filter_and_closing_end_the_stream() -> None:
    async with OffloadEngine(small_config()) as engine:
        broadcaster = EventBroadcaster(engine.event_hub)
        stream = broadcaster.stream(types=[EventType.EVICTED])
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        engine.event_hub.publish(EventType.STORED, [KEY])
        engine.event_hub.publish(EventType.EVICTED, [KEY])
        assert [m["event"] for m in _messages(await first)] == ["evicted"]
        assert engine.stats().event_subscribers == 1
        rest = asyncio.ensure_future(stream.__anext__())
        broadcaster.end_streams()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(rest, 5)


@pytest.mark.parametrize(
    "last_event_id",
    ["0123456789ab-9", "9999999999999999999", "0123456789ab-3"],
    ids=["other-run", "beyond-this-run", "other-run-low-seq"],
)
async def test_a_resume_id_from_another_run_replays_everything_after_a_restart_gap(
    last_event_id: str,
) -> None:
    """After a restart the old Last-Event-ID must not silently skip the new run's events."""
    async with OffloadEngine(small_config()) as engine:
        for _ in range(11):
            engine.event_hub.publish(EventType.STORED, [KEY])
        broadcaster = EventBroadcaster(engine.event_hub)
        since, restarted = broadcaster.resume_point(*parse_event_id(last_event_id))
        assert restarted
        stream = broadcaster.stream(since_seq=since, restarted=restarted)
        gap, *events = await _read(stream, 12)
        assert gap["event"] == "gap"
        assert json.loads(gap["data"]) == {"missed": 0, "next_seq": 1, "restarted": True}
        assert [_seq(m) for m in events] == list(range(1, 12))
        assert parse_event("gap", json.loads(gap["data"])) == GapMarker(0, 1, restarted=True)
        await stream.aclose()
        broadcaster.end_streams()


async def test_a_resume_id_of_this_run_is_not_stale() -> None:
    async with OffloadEngine(small_config()) as engine:
        engine.event_hub.publish(EventType.STORED, [KEY])
        broadcaster = EventBroadcaster(engine.event_hub)
        assert broadcaster.resume_point(*parse_event_id(f"{broadcaster.epoch}-1")) == (1, False)
        assert broadcaster.resume_point(None, 1) == (1, False)  # a bare id of an older client


def test_a_malformed_last_event_id_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match="Last-Event-ID must be an event id"):
        parse_event_id("x1")


async def test_a_chunk_for_one_client_is_bounded_in_bytes_whatever_the_backlog() -> None:
    """A client that stops reading holds one bounded chunk, not its whole backlog."""
    async with OffloadEngine(small_config()) as engine:
        broadcaster = EventBroadcaster(engine.event_hub)
        many_keys = [OffloadKey(i.to_bytes(8, "big") + b"\0\0\0\0") for i in range(1000)]
        for _ in range(200):  # ~25 KB per frame, ~5 MB of backlog
            engine.event_hub.publish(EventType.STORED, many_keys)
        stream = broadcaster.stream(since_seq=0)
        chunk = await stream.__anext__()
        frame = len(EventEncoder(epoch="0").encode(engine.event_hub.recent()[0]))
        assert len(chunk) <= 64 * 1024 + frame
        await stream.aclose()
        broadcaster.end_streams()


async def test_ending_the_streams_sends_what_was_published_then_stops() -> None:
    async with OffloadEngine(small_config()) as engine:
        broadcaster = EventBroadcaster(engine.event_hub)
        stream = broadcaster.stream(since_seq=0)
        for _ in range(3):
            engine.event_hub.publish(EventType.STORED, [KEY])
        broadcaster.end_streams()  # server shutdown
        engine.event_hub.publish(EventType.STORED, [KEY])  # after it: not sent
        with anyio.fail_after(5):
            chunks = [chunk async for chunk in stream]
        assert [_seq(m) for c in chunks for m in _messages(c)] == [1, 2, 3]
        assert broadcaster.subscribers == 0 and engine.stats().event_subscribers == 0


async def test_streams_in_step_and_out_of_step_each_get_their_own_sequence() -> None:
    """Streams reading in step share framed batches; one that started earlier must not."""
    async with OffloadEngine(small_config()) as engine:
        hub = engine.event_hub
        for _ in range(5):
            hub.publish(EventType.STORED, [KEY])
        broadcaster = EventBroadcaster(hub)
        streams = [broadcaster.stream(), broadcaster.stream(), broadcaster.stream(since_seq=2)]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await asyncio.sleep(0)
        for _ in range(300):
            hub.publish(EventType.STORED, [KEY])
        for stream, first, start in zip(streams, firsts, (6, 6, 3), strict=True):
            messages = _messages(await first)
            messages += await _read(stream, 306 - start - len(messages))
            assert [_seq(m) for m in messages] == list(range(start, 306))
            await stream.aclose()
