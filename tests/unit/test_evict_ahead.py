"""Evicting ahead: once a store's copy is on its way, the engine frees the room the next
store of its size needs, so that store's copy starts without an eviction in front of it.

What users rely on: the victims are the ones the next store would have evicted (same keys,
same slots), nothing being read or written is ever taken, every eviction is published and
counted, at most ``evict_ahead_fraction`` of the tier is kept free, and 0 turns it off.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvcache_offload.aio import EventType, OffloadEngine
from kvcache_offload.contracts.load_store_spec import BlockIDsLoadStoreSpec
from kvcache_offload.control.manager import CPUOffloadingManager
from tests.unit._aio_fakes import NO_KV, FakeHandler, FakeSpec, small_config, wait_for
from tests.unit._keys import key_ids, keys

POLICIES = ["lru", "arc", "adaptive", "s3fifo", "sieve", "lru2"]


def filled(policy: str, n: int = 16) -> CPUOffloadingManager:
    """A full tier of keys 0..n-1, some of them used again (so the policies disagree)."""
    manager = CPUOffloadingManager(n, policy, enable_events=True)
    for start in range(0, n, 4):
        ks = keys(*range(start, start + 4))
        out = manager.prepare_store(ks)
        assert out is not None
        manager.complete_store(out.keys_to_store)
    manager.touch(keys(3, 1, 7))
    manager.touch(keys(12))
    list(manager.take_events())
    return manager


def slot_ids(spec: object) -> list[int]:
    assert isinstance(spec, BlockIDsLoadStoreSpec)
    return [int(b) for b in spec.block_ids]


@pytest.mark.parametrize("policy", POLICIES)
def test_evicting_ahead_takes_the_victims_and_slots_the_next_store_would(policy: str) -> None:
    at_need, ahead = filled(policy), filled(policy)
    new = keys(100, 101, 102)

    out_at_need = at_need.prepare_store(new)
    evicted_ahead = ahead.evict_ahead(3)
    out_ahead = ahead.prepare_store(new)

    assert out_at_need is not None and out_ahead is not None
    assert len(evicted_ahead) == 3
    assert evicted_ahead == out_at_need.evicted_keys
    assert out_ahead.evicted_keys == []
    assert slot_ids(out_ahead.store_spec) == slot_ids(out_at_need.store_spec)
    assert ahead.stats().evictions == at_need.stats().evictions == 3


def test_evicting_ahead_publishes_one_eviction_event_and_frees_the_slots() -> None:
    manager = filled("lru")
    evicted = manager.evict_ahead(2)
    assert key_ids(evicted) == [0, 2]
    events = list(manager.take_events())
    assert [(e.removed, key_ids(e.keys)) for e in events] == [(True, [0, 2])]
    stats = manager.stats()
    assert (stats.free, stats.idle, stats.evictions) == (2, 14, 2)
    assert manager.lookup(evicted[0]) is False
    # Room already there: nothing more is evicted.
    assert manager.evict_ahead(2) == []
    assert manager.evict_ahead(1) == []
    assert list(manager.take_events()) == []


def test_evicting_ahead_never_takes_blocks_being_read_or_written() -> None:
    manager = CPUOffloadingManager(4, "lru", enable_events=True)
    out = manager.prepare_store(keys(0, 1, 2, 3))
    assert out is not None
    assert manager.evict_ahead(2) == []  # all four being written
    manager.complete_store(keys(0, 1))
    manager.prepare_load(keys(0))
    # One idle block (1): only it goes, though two were asked for.
    assert key_ids(manager.evict_ahead(2)) == [1]
    assert manager.lookup(keys(0)[0]) is True
    assert manager.lookup(keys(2)[0]) is None
    manager.complete_load(keys(0))
    assert key_ids(manager.evict_ahead(2)) == [0]


def test_evicting_ahead_takes_released_keys_first() -> None:
    manager, at_need = filled("lru"), filled("lru")
    assert manager.release(keys(9, 11)) == at_need.release(keys(9, 11)) == 2
    evicted = manager.evict_ahead(3)
    assert sorted(key_ids(evicted)) == [0, 9, 11]
    out = at_need.prepare_store(keys(100, 101, 102))
    assert out is not None and out.evicted_keys == evicted
    assert manager.stats().released_evictions == 2


def make_engine(num_blocks: int, **config: Any) -> OffloadEngine:
    cfg = small_config(num_blocks, eviction_policy="lru", **config)
    return OffloadEngine(cfg, spec=FakeSpec(cfg), kv_caches=NO_KV)


async def test_an_engine_store_evicts_ahead_for_the_next_store_and_reports_it() -> None:
    async with make_engine(64) as engine:  # 1/32 of 64 blocks: at most 2 kept free
        await engine.store(keys(*range(64)), list(range(64)))
        assert engine.stats().evicted_blocks == 0

        first = await engine.store(keys(100, 101), [0, 1])
        # Two evicted for its own room, two ahead for the next store of two.
        assert key_ids(first.evicted_keys) == [0, 1, 2, 3]
        assert engine.manager.stats().free == 2  # type: ignore[attr-defined]

        second = await engine.store(keys(102, 103), [2, 3])
        assert key_ids(second.evicted_keys) == [4, 5]  # both ahead: its room was there
        stats = engine.stats()
        assert (stats.evicted_blocks, stats.evicted_ahead_blocks) == (6, 4)
        evicted_events = [
            key_ids(e.keys) for e in engine.event_hub.recent(0) if e.type is EventType.EVICTED
        ]
        assert evicted_events == [[0, 1], [2, 3], [4, 5]]
        assert (await engine.lookup(keys(100, 101, 102, 103))).hits == 4
        assert (await engine.lookup(keys(6))).hits == 1


async def test_the_free_reserve_is_capped_by_the_fraction_of_the_tier() -> None:
    async with make_engine(64) as engine:
        await engine.store(keys(*range(64)), list(range(64)))
        result = await engine.store(keys(*range(100, 108)), list(range(8)))
        # Eight evicted for its room, two (1/32 of 64) ahead.
        assert len(result.evicted_keys) == 10
        assert engine.manager.stats().free == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("num_blocks", "fraction"), [(64, 0.0), (16, 1 / 32)], ids=["off", "small-tier"]
)
async def test_no_room_is_kept_when_off_or_in_a_tier_too_small(
    num_blocks: int, fraction: float
) -> None:
    async with make_engine(num_blocks, evict_ahead_fraction=fraction) as engine:
        await engine.store(keys(*range(num_blocks)), list(range(num_blocks)))
        result = await engine.store(keys(100, 101), [0, 1])
        assert key_ids(result.evicted_keys) == [0, 1]
        assert engine.manager.stats().free == 0  # type: ignore[attr-defined]
        assert (engine.stats().evicted_blocks, engine.stats().evicted_ahead_blocks) == (2, 0)


async def test_stores_behind_other_jobs_in_flight_evict_only_at_need() -> None:
    # In a stream the loop thread is the bottleneck and no lone copy hides the work: only a
    # store whose copy is in flight alone evicts ahead.
    handler = FakeHandler()
    cfg = small_config(64, eviction_policy="lru")
    async with OffloadEngine(cfg, spec=FakeSpec(cfg, handler), kv_caches=NO_KV) as engine:
        await engine.store(keys(*range(64)), list(range(64)))
        handler.auto = False  # copies now end when the test says
        lone = asyncio.create_task(engine.store(keys(100, 101), [0, 1]))
        await wait_for(lambda: len(handler.pending) == 1)
        behind = asyncio.create_task(engine.store(keys(102, 103), [2, 3]))
        await wait_for(lambda: len(handler.pending) == 2)
        third = asyncio.create_task(engine.store(keys(104, 105), [4, 5]))
        await wait_for(lambda: len(handler.pending) == 3)
        handler.release()
        results = await asyncio.gather(lone, behind, third)
        # The lone one: two for its room, two ahead; the next found that room and evicted
        # nothing; the third evicted its own two.
        assert [key_ids(r.evicted_keys) for r in results] == [[0, 1, 2, 3], [], [4, 5]]
        assert engine.manager.stats().free == 0  # type: ignore[attr-defined]
