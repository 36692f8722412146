"""Write-through under backlog: by default a full tier write queue drops writes and counts
them; with ``tier_write_backpressure`` stores wait for room instead, so none is dropped, and a
wait that times out lets the store go on."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvcache_offload import KVCacheLayout, OffloadConfig
from kvcache_offload.aio import OffloadEngine
from tests.unit._aio_fakes import wait_for
from tests.unit._keys import key
from tests.unit._slow_tier import SlowTier, unused_dir, use_tiers

BLOCK = 1024
STORES = 6


def engine_with(tmp_path: Path, **tiering: object) -> tuple[OffloadEngine, SlowTier]:
    engine = OffloadEngine(
        OffloadConfig(
            cpu_bytes_to_use=16 * BLOCK,
            layout=KVCacheLayout(bytes_per_block=BLOCK),
            backend="cpu",
            disk_path=unused_dir(tmp_path),
            tier_queue_size=1,
            **tiering,  # type: ignore[arg-type]
        )
    )
    slow = SlowTier()
    use_tiers(engine, slow, queue_size=1)
    slow.gate.clear()
    return engine, slow


async def store_each(engine: OffloadEngine) -> None:
    for i in range(STORES):
        await engine.write_blocks([key(i)], [bytes([i]) * BLOCK])


async def test_a_full_write_queue_drops_writes_and_reports_them(tmp_path: Path) -> None:
    engine, slow = engine_with(tmp_path)
    async with engine:
        await store_each(engine)  # never waits for the tier
        stats = engine.stats()
        assert stats.tier_write_queue_full_blocks > 0
        assert stats.tiers[0].writes_dropped == stats.tier_write_queue_full_blocks
        assert stats.tier_write_backpressure_waits == 0
        slow.gate.set()


async def test_with_backpressure_stores_wait_for_room_and_no_write_is_dropped(
    tmp_path: Path,
) -> None:
    engine, slow = engine_with(
        tmp_path, tier_write_backpressure=True, tier_write_backpressure_timeout_s=60
    )
    async with engine:
        stores = asyncio.create_task(store_each(engine))
        await wait_for(lambda: engine.stats().tier_write_backpressure_waits >= 1)
        assert not stores.done()  # held back by the tier, not dropping its writes
        slow.gate.set()
        await stores
        assert engine._tiers is not None
        assert await engine._tiers.tier_set.drain(10)
        stats = engine.stats()
        assert stats.tier_write_queue_full_blocks == 0
        assert stats.tier_write_backpressure_timeouts == 0
        assert sorted(slow.blocks) == sorted(key(i) for i in range(STORES))


async def test_a_store_whose_wait_times_out_goes_on(tmp_path: Path) -> None:
    engine, slow = engine_with(
        tmp_path, tier_write_backpressure=True, tier_write_backpressure_timeout_s=0.01
    )
    async with engine:
        await store_each(engine)  # returns although the tier never makes room
        stats = engine.stats()
        assert stats.tier_write_backpressure_timeouts >= 1
        assert (await engine.lookup([key(i) for i in range(STORES)])).hits == STORES
        slow.gate.set()
