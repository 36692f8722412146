"""OffloadEngine over the real CPU backend: bytes survive store -> load under concurrency."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kvcache_offload.dataplane.handlers.cpu_backend")

from kvcache_offload import (  # noqa: E402
    KVCacheLayout,
    OffloadConfig,
)
from kvcache_offload.aio import (  # noqa: E402
    EngineEvent,
    EventType,
    GapMarker,
    OffloadEngine,
    StoreResult,
)
from kvcache_offload.contracts.kv_caches import CanonicalKVCaches  # noqa: E402
from kvcache_offload.dataplane import layouts  # noqa: E402
from kvcache_offload.errors import OffloadError  # noqa: E402
from tests._regions import region_name  # noqa: E402
from tests.unit._aio_fakes import wait_for  # noqa: E402
from tests.unit._keys import key_ids, keys  # noqa: E402

NUM_GPU_BLOCKS = 32
NUM_LAYERS = 2


def make_kv(seed: int = 0) -> tuple[list[Any], CanonicalKVCaches]:
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(-128, 127, (NUM_GPU_BLOCKS, 2, 16, 2, 8), dtype=torch.int8, generator=gen)
        for _ in range(NUM_LAYERS)
    ]
    return tensors, layouts.blocks_first_per_layer(tensors)


def gpu_block(tensors: list[Any], b: int) -> bytes:
    return b"".join(t[b].numpy().tobytes() for t in tensors)


def build_engine(num_cpu_blocks: int = 64, block_size: int | None = None, **kw: Any) -> tuple[
    OffloadEngine, list[Any]
]:  # fmt: skip
    tensors, kv = make_kv()
    page = layouts.block_nbytes(kv)
    config = OffloadConfig(
        cpu_bytes_to_use=num_cpu_blocks * page * ((block_size or 16) // 16),
        block_size=block_size,
        layout=KVCacheLayout(
            gpu_block_sizes=[16], bytes_per_block=page, num_gpu_blocks=NUM_GPU_BLOCKS
        ),
        backend="cpu",
        **kw.pop("config", {}),
    )
    return OffloadEngine(config, kv_caches=kv, **kw), tensors


@pytest.fixture
async def engine_and_kv() -> AsyncIterator[tuple[OffloadEngine, list[Any]]]:
    engine, tensors = build_engine()
    async with engine:
        yield engine, tensors


async def test_concurrent_stores_lookups_and_loads_move_the_exact_bytes(
    engine_and_kv: tuple[OffloadEngine, list[Any]],
) -> None:
    engine, tensors = engine_and_kv
    expected = {i: gpu_block(tensors, i) for i in range(16)}

    async def store(i: int) -> None:
        ks = keys(2 * i, 2 * i + 1)
        await engine.store(ks, [2 * i, 2 * i + 1])
        result = await engine.lookup(ks)
        assert result.hits == 2

    async def lookups() -> None:
        for _ in range(50):
            result = await engine.lookup(keys(*range(16)))
            assert result.hits <= 16
            await asyncio.sleep(0)

    async with asyncio.timeout(30):
        await asyncio.gather(*(store(i) for i in range(8)), lookups(), lookups())
    for t in tensors:
        t[16:].zero_()

    async def load(i: int) -> None:
        await engine.load(keys(i), [16 + i])

    async with asyncio.timeout(30):
        await asyncio.gather(*(load(i) for i in range(16)))
    for i in range(16):
        assert gpu_block(tensors, 16 + i) == expected[i], f"block {i} differs after load"
    stats = engine.stats()
    assert stats.blocks_reading == 0 and stats.blocks_writing == 0
    assert stats.transfer_bytes["gpu_to_cpu"] == 16 * len(expected[0])
    assert stats.transfer_bytes["cpu_to_gpu"] == 16 * len(expected[0])


async def test_stored_blocks_are_readable_as_bytes_and_written_bytes_load(
    engine_and_kv: tuple[OffloadEngine, list[Any]],
) -> None:
    engine, tensors = engine_and_kv
    await engine.store(keys(1), [3])
    assert await engine.read_block(keys(1)[0]) == gpu_block(tensors, 3)
    blob = bytes(range(256)) * (engine.block_nbytes // 256)
    assert len(blob) == engine.block_nbytes
    await engine.write_blocks(keys(2), [blob])
    await engine.load(keys(2), [30])
    assert gpu_block(tensors, 30) == blob


async def test_block_size_factor_two_round_trips_pairs_of_gpu_blocks() -> None:
    engine, tensors = build_engine(num_cpu_blocks=8, block_size=32)
    async with engine:
        expected = gpu_block(tensors, 4) + gpu_block(tensors, 5)
        await engine.store(keys(1), [4, 5])
        await engine.load(keys(1), [20, 21])
        assert gpu_block(tensors, 20) + gpu_block(tensors, 21) == expected


async def test_events_arrive_in_sequence_order_for_every_stored_key(
    engine_and_kv: tuple[OffloadEngine, list[Any]],
) -> None:
    engine, _ = engine_and_kv
    sub = engine.subscribe(types=[EventType.STORED])
    async with asyncio.timeout(30):
        await asyncio.gather(*(engine.store(keys(i), [i]) for i in range(10)))
    got: list[EngineEvent] = []
    while len({k for e in got for k in e.keys}) < 10:
        item = await asyncio.wait_for(sub.__anext__(), 5)
        assert isinstance(item, EngineEvent)
        got.append(item)
    seqs = [e.seq for e in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert sorted(key_ids(k for e in got for k in e.keys)) == list(range(10))


async def test_slow_subscriber_does_not_block_stores_and_gets_one_gap() -> None:
    engine, _ = build_engine()
    async with engine:
        slow = engine.subscribe(queue_size=2)
        async with asyncio.timeout(30):
            for i in range(12):
                await engine.store(keys(i), [i])
        items = []
        while (item := slow.get_nowait()) is not None:
            items.append(item)
        gaps = [i for i in items if isinstance(i, GapMarker)]
        assert len(gaps) == 1 and gaps[0].missed == 10
        assert engine.stats().events_dropped == 10
        # The ring still holds what the gap skipped: resume right after the last one seen.
        last_seen = max(i.seq for i in items if isinstance(i, EngineEvent))
        resumed = engine.subscribe(since_seq=last_seen)
        replayed = []
        while (item := resumed.get_nowait()) is not None:
            replayed.append(item)
        assert [e.seq for e in replayed] == list(range(last_seen + 1, gaps[0].next_seq))


async def test_shutdown_with_jobs_in_flight_completes_or_fails_every_store() -> None:
    engine, _ = build_engine()
    await engine.start()
    tasks = [asyncio.create_task(engine.store(keys(i), [i])) for i in range(16)]
    await wait_for(lambda: engine.stats().transfers_in_flight > 0 or all(t.done() for t in tasks))
    await asyncio.wait_for(engine.aclose(), 30)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    # Jobs submitted before aclose drain to completion; later calls see a closed engine.
    for i, r in enumerate(results):
        if isinstance(r, BaseException):
            assert isinstance(r, OffloadError) and "closed" in str(r), repr(r)
        else:
            assert isinstance(r, StoreResult) and r.keys_stored == keys(i)
    assert any(isinstance(r, StoreResult) for r in results)
    assert engine.stats().transfers_in_flight == 0
    assert engine.stats().blocks_writing == 0


async def test_shared_region_engine_serves_block_bytes_and_cleans_up() -> None:
    pytest.importorskip("kvcache_offload.dataplane.memory.shared_offload_region")
    import os

    page = 4096
    config = OffloadConfig(
        cpu_bytes_to_use=16 * page,
        layout=KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=page),
        shared_region=True,
        region_name=region_name("aio-test"),
    )
    engine = OffloadEngine(config)
    async with engine:
        info = engine.region_info()
        assert info is not None and info["num_blocks"] == 16
        blob = os.urandom(engine.block_nbytes)
        await engine.write_blocks(keys(7), [blob])
        assert await engine.read_block(keys(7)[0]) == blob
    assert engine.closed
    assert not [f for f in os.listdir("/dev/shm") if config.region_name in f]


async def test_a_copy_the_backend_rejects_rolls_the_store_back(
    engine_and_kv: tuple[OffloadEngine, list[Any]],
) -> None:
    engine, _ = engine_and_kv
    sub = engine.subscribe(types=[EventType.STORE_FAILED])
    with pytest.raises(OffloadError):
        await engine.store(keys(1, 2), [0, NUM_GPU_BLOCKS + 100])  # no such GPU block
    event = await asyncio.wait_for(sub.__anext__(), 5)
    assert isinstance(event, EngineEvent) and key_ids(event.keys) == [1, 2]
    assert (await engine.lookup(keys(1, 2))).hits == 0
    stats = engine.stats()
    assert stats.blocks_writing == 0 and stats.blocks_free == stats.capacity_blocks
    await engine.store(keys(1), [0])  # the engine keeps working
    assert (await engine.lookup(keys(1))).hits == 1


async def test_stores_copied_inline_choose_their_victims_at_need() -> None:
    # A small lone store is copied during its submission: no copy runs afterwards for the
    # policy's choice to hide behind, so nothing is chosen ahead (the choice would only add
    # to the store's own time).
    engine, _ = build_engine(num_cpu_blocks=64, config={"eviction_policy": "lru"})
    async with engine:
        for start in range(0, 64, 8):
            await engine.store(keys(*range(start, start + 8)), list(range(8)))
        result = await engine.store(keys(100, 101), [0, 1])
        assert key_ids(result.evicted_keys) == [0, 1]
        assert engine.manager.stats().chosen_ahead == 0  # type: ignore[attr-defined]
        assert engine.stats().evicted_ahead_blocks == 0
