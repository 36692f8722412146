"""EventHub: sequence numbers, fan-out, bounded queues with one gap marker, replay, filters."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvcache_offload.aio import EngineEvent, EventHub, EventType, GapMarker
from kvcache_offload.errors import ConfigError
from kvcache_offload.events import hub as event_hub
from tests.unit._keys import keys


def drain(sub):  # type: ignore[no-untyped-def]
    out = []
    while (item := sub.get_nowait()) is not None:
        out.append(item)
    return out


def publish_n(hub: EventHub, n: int, type: EventType = EventType.STORED) -> None:
    for i in range(n):
        hub.publish(type, keys(i))


async def test_sequence_numbers_are_consecutive_from_one_with_timestamps() -> None:
    hub = EventHub(buffer_size=10, queue_size=10)
    sub = hub.subscribe()
    publish_n(hub, 3)
    got = drain(sub)
    assert [e.seq for e in got] == [1, 2, 3]
    assert all(isinstance(e, EngineEvent) and e.timestamp > 0 for e in got)
    assert hub.last_seq == 3
    assert hub.published == {"stored": 3}


async def test_slow_subscriber_gets_one_gap_marker_then_continues() -> None:
    hub = EventHub(buffer_size=100, queue_size=3)
    slow = hub.subscribe()
    fast = hub.subscribe(queue_size=100)
    publish_n(hub, 10)  # slow keeps 1..3, misses 4..10
    publish_n(hub, 0)
    got = drain(slow)
    assert [e.seq for e in got if isinstance(e, EngineEvent)] == [1, 2, 3]
    assert got[-1] == GapMarker(missed=7, next_seq=11)
    assert sum(isinstance(e, GapMarker) for e in got) == 1
    hub.publish(EventType.EVICTED, keys(99))
    (after,) = drain(slow)
    assert isinstance(after, EngineEvent) and after.seq == 11
    assert [e.seq for e in drain(fast)] == list(range(1, 12))
    assert hub.dropped == 7


async def test_gap_marker_precedes_the_next_event_when_the_queue_has_room_again() -> None:
    hub = EventHub(buffer_size=100, queue_size=2)
    sub = hub.subscribe()
    publish_n(hub, 5)  # keeps 1,2; misses 3,4,5
    assert [e.seq for e in (sub.get_nowait(), sub.get_nowait())] == [1, 2]  # type: ignore[union-attr]
    hub.publish(EventType.STORED, keys(6))  # room again: gap then event 6
    got = drain(sub)
    assert got == [GapMarker(missed=3, next_seq=6), got[1]]
    assert isinstance(got[1], EngineEvent) and got[1].seq == 6


async def test_resume_from_sequence_replays_newer_events_from_the_ring() -> None:
    hub = EventHub(buffer_size=100, queue_size=10)
    publish_n(hub, 5)
    sub = hub.subscribe(since_seq=2)
    hub.publish(EventType.EVICTED, keys(50))
    assert [e.seq for e in drain(sub)] == [3, 4, 5, 6]


async def test_resume_after_events_left_the_ring_starts_with_a_gap() -> None:
    hub = EventHub(buffer_size=4, queue_size=10)
    publish_n(hub, 10)  # ring holds 7..10
    sub = hub.subscribe(since_seq=3)
    got = drain(sub)
    assert got[0] == GapMarker(missed=3, next_seq=7)
    assert [e.seq for e in got[1:]] == [7, 8, 9, 10]


async def test_resume_from_the_latest_sequence_replays_nothing() -> None:
    hub = EventHub(buffer_size=4, queue_size=10)
    publish_n(hub, 3)
    assert drain(hub.subscribe(since_seq=3)) == []
    assert drain(hub.subscribe(since_seq=50)) == []


async def test_type_filter_delivers_only_chosen_types() -> None:
    hub = EventHub(buffer_size=10, queue_size=10)
    sub = hub.subscribe(types=["evicted"])
    hub.publish(EventType.STORED, keys(1))
    hub.publish(EventType.EVICTED, keys(2))
    hub.publish(EventType.RESET, [])
    got = drain(sub)
    assert [(e.seq, e.type) for e in got] == [(2, EventType.EVICTED)]


async def test_unknown_event_type_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        EventHub().subscribe(types=["nope"])


async def test_closing_a_subscription_unsubscribes_it() -> None:
    hub = EventHub()
    async with hub.subscribe():
        assert hub.subscribers == 1
    assert hub.subscribers == 0
    hub.publish(EventType.STORED, keys(1))  # no error publishing after unsubscribe


async def test_hub_close_ends_iteration_after_queued_events() -> None:
    hub = EventHub()
    sub = hub.subscribe()
    publish_n(hub, 2)
    hub.close()
    got = [e async for e in sub]
    assert [e.seq for e in got] == [1, 2]


async def test_async_iteration_waits_for_the_next_event() -> None:
    import asyncio

    hub = EventHub()
    sub = hub.subscribe()
    task = asyncio.create_task(sub.__anext__())
    await asyncio.sleep(0)
    assert not task.done()
    hub.publish(EventType.STORED, keys(7))
    event = await asyncio.wait_for(task, 1)
    assert isinstance(event, EngineEvent) and event.keys == keys(7)


def test_a_cursor_reads_the_ring_in_order_and_a_gap_for_what_left_it() -> None:
    hub = EventHub(buffer_size=4)
    cursor = hub.cursor(after_seq=0)
    assert hub.subscribers == 1
    for _ in range(6):
        hub.publish(EventType.STORED, [])
    gap, *events = cursor.take(10)
    assert gap == GapMarker(missed=2, next_seq=3)
    assert [e.seq for e in events] == [3, 4, 5, 6] and cursor.seq == 6
    assert hub.dropped == 2
    hub.publish(EventType.EVICTED, [])
    assert [e.seq for e in cursor.take(10)] == [7] and cursor.take(10) == []
    cursor.close()
    cursor.close()
    assert hub.subscribers == 0


async def test_a_cursor_wait_returns_on_a_new_event_and_false_after_close() -> None:
    hub = EventHub()
    cursor = hub.cursor()
    waiting = asyncio.ensure_future(cursor.wait())
    await asyncio.sleep(0)
    hub.publish(EventType.STORED, [])
    assert await asyncio.wait_for(waiting, 5) is True
    assert [e.seq for e in cursor.take(1)] == [1]
    waiting = asyncio.ensure_future(cursor.wait())
    await asyncio.sleep(0)
    hub.close()
    assert await asyncio.wait_for(waiting, 5) is False


def test_the_fast_event_sets_every_field_of_the_dataclass_in_order():
    names = [f.name for f in dataclasses.fields(EngineEvent)]
    assert len(event_hub._EVENT_SLOTS) == len(names)
    built = event_hub._new_event(7, 1.5, EventType.EVICTED, [b"k" * 12], "GPU", {"a": 1})
    assert built == EngineEvent(7, 1.5, EventType.EVICTED, [b"k" * 12], "GPU", {"a": 1})
    assert [getattr(built, n) for n in names] == [
        7,
        1.5,
        EventType.EVICTED,
        [b"k" * 12],
        "GPU",
        {"a": 1},
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.seq = 8  # type: ignore[misc]


def test_published_counts_are_keyed_by_the_event_types_name():
    hub = EventHub()
    hub.publish(EventType.STORED, [b"k" * 12])
    hub.publish(EventType.STORED, [b"j" * 12])
    hub.publish(EventType.LOAD_COMPLETED, [b"k" * 12])
    assert hub.published == {"stored": 2, "load_completed": 1}
