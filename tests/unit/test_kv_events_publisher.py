"""The ZMQ publisher as a router sees it: every event type, replay, bounded cost, clean close."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import zmq
import zmq.asyncio

from kvcache_offload.aio import OffloadEngine
from kvcache_offload.aio.types import EventType
from kvcache_offload.contracts.offload_key import (
    OffloadKey,
    make_offload_key,
)
from kvcache_offload.errors import ConfigError
from kvcache_offload.events.hub import EventHub
from kvcache_offload.kv_events import KVEventPublisher, external_block_hash
from kvcache_offload.kv_events import publisher as publisher_module
from tests.unit._api_app import small_config
from tests.unit._kv_subscriber import DocSubscriber

ANY_PORT = "tcp://127.0.0.1:*"


def key(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), group)


def kinds(events: list[Any]) -> list[str]:
    return [type(e).__name__ for e in events]


@asynccontextmanager
async def engine_and_subscriber(
    **overrides: Any,
) -> AsyncIterator[tuple[OffloadEngine, DocSubscriber]]:
    config = small_config(
        kv_events_endpoint=ANY_PORT, kv_events_replay_endpoint=ANY_PORT, **overrides
    )
    async with OffloadEngine(config) as engine:
        pub = engine.kv_events
        assert pub is not None and pub.replay_endpoint is not None
        sub = DocSubscriber(
            pub.endpoint, pub.replay_endpoint, config.kv_events_topic, config.kv_events_encoding
        )
        try:
            yield engine, sub
        finally:
            sub.close()


async def store(engine: OffloadEngine, keys: list[OffloadKey]) -> list[OffloadKey]:
    lease = await engine.prepare_store(keys)
    await engine.complete_store(lease.lease_id)
    return lease.evicted_keys


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_stores_evictions_and_reset_reach_a_subscriber_written_from_the_docs(
    encoding: str,
) -> None:
    async with engine_and_subscriber(kv_events_encoding=encoding, kv_events_topic="kv-events") as (
        engine,
        sub,
    ):
        await store(engine, [key(i) for i in range(16)])  # fills the 16-block tier
        evicted = await store(engine, [key(100), key(101)])
        assert len(evicted) == 2
        await engine.reset()
        await sub.collect(lambda s: "AllBlocksCleared" in kinds(s.events))
    events = sub.events
    assert kinds(events) == ["BlockStored", "BlockRemoved", "BlockStored", "AllBlocksCleared"]
    first, removed, second, _ = events
    assert first.block_hashes == [external_block_hash(key(i)[:-4], "int") for i in range(16)]
    assert (first.medium, first.group_idx, first.block_size, first.token_ids) == ("CPU", 0, 16, [])
    assert removed.block_hashes == [external_block_hash(k[:-4], "int") for k in evicted]
    assert second.block_hashes == [100, 101]
    assert [seq for seq, _ in sub.batches] == list(range(len(sub.batches)))
    assert all(batch.data_parallel_rank == 0 for _, batch in sub.batches)


async def test_a_late_subscriber_replays_the_batches_it_missed_then_follows_live() -> None:
    async with engine_and_subscriber() as (engine, early):
        pub = engine.kv_events
        assert pub is not None and pub.replay_endpoint is not None
        missed = [
            pub.send_batch([pub.codec.removed([i], medium="CPU", group_idx=0)]) for i in range(5)
        ]
        assert missed == list(range(5))
        # A subscriber that connects only now has missed seqs 0-4 for certain.
        sub = DocSubscriber(pub.endpoint, pub.replay_endpoint, early.topic)
        try:
            # Wait until the subscription is live: the first batch it sees has seq >= 5.
            with anyio.fail_after(10):
                while not await sub.receive_once(0.05):
                    pub.send_batch([pub.codec.cleared()])
            assert sub.live_seqs[0] >= 5
            live = sub.live_seqs[0]
            assert sub.replayed_seqs[:live] == list(range(live))  # may include ``live``
            # Batches sent while the replay ran may come with it: contiguous from 0, past live.
            seqs = [seq for seq, _ in sub.batches]
            assert seqs == list(range(len(seqs))) and len(seqs) >= live + 1
            assert [e.block_hashes for e in sub.events[:5]] == [[i] for i in range(5)]
        finally:
            sub.close()
        assert engine.stats().kv_events is not None
        stats = engine.stats().kv_events
        assert stats is not None and stats.replay_requests == 1
        assert stats.batches_replayed >= live


async def test_replay_buffer_keeps_at_least_the_sse_ring_depth() -> None:
    async with engine_and_subscriber(event_buffer_size=50, kv_events_replay_batches=10) as (
        engine,
        sub,
    ):
        pub = engine.kv_events
        assert pub is not None
        for i in range(60):
            pub.send_batch([pub.codec.removed([i], medium="CPU", group_idx=0)])
        sub.next_seq = 0
        await sub.replay()
        assert [seq for seq, _ in pub.buffered] == list(range(10, 60))
        assert sub.batches == []  # seq 0 is gone, so nothing joins on from 0
        sub.next_seq = 10
        await sub.replay()
        assert [seq for seq, _ in sub.batches] == list(range(10, 60))


async def test_malformed_replay_requests_get_the_end_marker_only() -> None:
    async with engine_and_subscriber() as (engine, _):
        pub = engine.kv_events
        assert pub is not None and pub.replay_endpoint is not None
        pub.send_batch([pub.codec.cleared()])
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        try:
            await dealer.send(b"\x00\x01\x02")  # not an 8-byte sequence number
            with anyio.fail_after(10):
                assert await dealer.recv_multipart() == [(-1).to_bytes(8, "big", signed=True), b""]
            await dealer.send((0).to_bytes(8, "big"))  # DEALER without a delimiter works too
            with anyio.fail_after(10):
                seq, payload = await dealer.recv_multipart()
                assert int.from_bytes(seq, "big") == 0 and payload
                assert (await dealer.recv_multipart())[1] == b""
        finally:
            dealer.close(linger=0)
            ctx.term()


async def test_an_absent_or_stalled_subscriber_never_blocks_publishing() -> None:
    async with engine_and_subscriber(kv_events_hwm=10) as (engine, sub):
        pub = engine.kv_events
        assert pub is not None
        with anyio.fail_after(30):  # a hang guard, not a timing assertion
            for i in range(20_000):  # the subscriber connected but never reads
                pub.send_batch([pub.codec.removed([i], medium="CPU", group_idx=0)])
        assert pub.next_seq == 20_000
        del sub


async def test_a_busy_or_malformed_endpoint_is_a_config_error() -> None:
    hub = EventHub()
    first = KVEventPublisher(hub, ANY_PORT)
    try:
        with pytest.raises(ConfigError, match="KV-event sockets"):
            KVEventPublisher(hub, first.endpoint.replace("127.0.0.1", "*"))
        with pytest.raises(ConfigError):
            KVEventPublisher(hub, "tcp://*:not-a-port")
    finally:
        await first.aclose()


async def test_closing_the_engine_ends_the_task_and_frees_the_ports() -> None:
    config = small_config(kv_events_endpoint=ANY_PORT, kv_events_replay_endpoint=ANY_PORT)
    async with OffloadEngine(config) as engine:
        pub = engine.kv_events
        assert pub is not None and pub.replay_endpoint is not None
        endpoints = (pub.endpoint, pub.replay_endpoint)
    again = small_config(
        kv_events_endpoint=endpoints[0].replace("127.0.0.1", "*"),
        kv_events_replay_endpoint=endpoints[1],
    )
    async with OffloadEngine(again) as engine:
        assert engine.kv_events is not None


async def test_publishing_is_off_unless_an_endpoint_is_configured() -> None:
    async with OffloadEngine(small_config()) as engine:
        assert engine.kv_events is None
        assert engine.stats().kv_events is None


async def test_events_the_hub_queue_dropped_are_recovered_from_its_ring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(publisher_module, "_QUEUE_FLOOR", 1)
    hub = EventHub(buffer_size=500)
    pub = KVEventPublisher(hub, ANY_PORT)
    try:
        for i in range(800):  # without yielding: the 500-event queue overflows
            hub.publish(EventType.STORED, [key(i)])
        pub.flush()
        assert pub.stats().events_lost == 0
        hashes = [
            h
            for _, payload in pub.buffered
            for e in pub.codec.decode_batch(payload).events
            for h in e.block_hashes
        ]
        assert hashes == list(range(800))
    finally:
        await pub.aclose()


async def test_events_gone_from_the_ring_are_counted_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publisher_module, "_QUEUE_FLOOR", 1)
    hub = EventHub(buffer_size=100)
    pub = KVEventPublisher(hub, ANY_PORT)
    try:
        for i in range(300):
            hub.publish(EventType.EVICTED, [key(i)])
        pub.flush()
        # 100 queued, the newest 100 recovered from the ring, 100 in between lost.
        assert pub.stats().events_lost == 100
    finally:
        await pub.aclose()


def test_settings_come_from_a_config_file_and_the_environment_overrides_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcache_offload.config import load_config

    path = tmp_path / "offload.toml"
    path.write_text(
        'kv_events_endpoint = "tcp://*:5557"\n'
        'kv_events_replay_endpoint = "tcp://*:5558"\n'
        'kv_events_topic = "kv"\n'
        'kv_events_media = { CPU = "CPU_TIER1" }\n'
    )
    config = load_config(path)
    assert (config.kv_events_endpoint, config.kv_events_replay_endpoint) == (
        "tcp://*:5557",
        "tcp://*:5558",
    )
    assert (config.kv_events_topic, config.kv_events_media) == ("kv", {"CPU": "CPU_TIER1"})
    monkeypatch.setenv("KVCACHE_OFFLOAD_KV_EVENTS_TOPIC", "from-env")
    monkeypatch.setenv("KVCACHE_OFFLOAD_KV_EVENTS_ENCODING", "map")
    config = load_config(path)
    assert (config.kv_events_topic, config.kv_events_encoding) == ("from-env", "map")
    monkeypatch.setenv("KVCACHE_OFFLOAD_KV_EVENTS_ENCODING", "yaml")
    with pytest.raises(ConfigError, match="kv_events_encoding"):
        load_config(path)


async def test_the_configured_media_names_reach_the_wire() -> None:
    async with engine_and_subscriber(kv_events_media={"CPU": "CPU_TIER1"}) as (engine, sub):
        await store(engine, [key(1)])
        await sub.collect(lambda s: len(s.events) == 1)
    assert sub.events[0].medium == "CPU_TIER1"
