"""Discard: a serving engine frees a finished session's blocks, in the library and over HTTP."""

from __future__ import annotations

import httpx
import pytest

from kvcache_offload.aio import EventType, KeyState, OffloadEngine
from kvcache_offload.client import OffloadClient
from kvcache_offload.control.manager import CPUOffloadingManager
from kvcache_offload.errors import InvalidKeyError, OffloadError
from tests.unit._aio_fakes import NO_KV, FakeSpec, small_config
from tests.unit._api_app import hex_key, served, store
from tests.unit._keys import key_ids, keys


def make_engine(num_blocks: int = 8) -> OffloadEngine:
    config = small_config(num_blocks)
    return OffloadEngine(config, spec=FakeSpec(config), kv_caches=NO_KV)


async def test_discard_frees_idle_blocks_for_the_next_store_instead_of_evicting() -> None:
    async with make_engine(num_blocks=4) as engine:
        await engine.store(keys(1, 2, 3, 4), [0, 1, 2, 3])
        assert key_ids(await engine.discard(keys(3, 4, 9))) == [3, 4]  # 9 was never stored
        result = await engine.store(keys(5, 6), [0, 1])
        assert result.evicted_keys == []  # the discarded slots took them
        states = (await engine.lookup(keys(1, 2, 3, 5))).states
        assert states == [KeyState.READY, KeyState.READY, KeyState.ABSENT, KeyState.READY]
        stats = engine.stats()
        assert (stats.discarded_blocks, stats.evicted_blocks) == (2, 0)
        discarded = [e for e in engine.event_hub.recent(0) if e.type == EventType.EVICTED]
        assert [key_ids(e.keys) for e in discarded] == [[3, 4]]


async def test_discard_leaves_blocks_being_written_or_read_alone() -> None:
    async with make_engine() as engine:
        await engine.store(keys(1), [0])
        lease = await engine.prepare_store(keys(2))
        load = await engine.prepare_load(keys(1))
        assert await engine.discard(keys(1, 2)) == []
        await engine.complete_load(load.lease_id)
        await engine.complete_store(lease.lease_id)
        assert key_ids(await engine.discard(keys(1, 2))) == [1, 2]


async def test_discard_rejects_malformed_keys_and_a_closed_engine() -> None:
    engine = make_engine()
    async with engine:
        await engine.store(keys(1), [0])
        with pytest.raises(InvalidKeyError):
            await engine.discard([keys(1)[0], b"x"])
        assert (await engine.lookup(keys(1))).hits == 1  # nothing changed
    with pytest.raises(OffloadError, match="closed"):
        await engine.discard(keys(1))


def test_a_discarded_slot_is_handed_out_again_in_the_state_a_store_needs() -> None:
    manager = CPUOffloadingManager(2, "lru")
    manager.prepare_store(keys(1, 2))
    manager.complete_store(keys(1, 2))
    assert manager.discard(keys(1)) == keys(1)
    out = manager.prepare_store(keys(3))
    assert out is not None and out.evicted_keys == []
    assert manager.lookup(keys(3)[0]) is None  # being written, not ready
    assert manager.stats().discarded_blocks == 1


async def test_discard_over_http_and_through_the_client() -> None:
    async with served() as s:
        await store(s.client, [hex_key(1), hex_key(2), hex_key(3)])
        r = await s.client.post("/v1/discard", json={"keys": [hex_key(1), hex_key(7)]})
        assert r.status_code == 200, r.text
        assert r.json() == {"discarded": [hex_key(1)]}
        transport = httpx.ASGITransport(app=s.app)
        async with OffloadClient("http://test", transport=transport) as client:
            assert [k.hex() for k in await client.discard([hex_key(2)])] == [hex_key(2)]
        r = await s.client.post("/v1/discard", json={"keys": ["zz"]})
        assert r.status_code == 422
        metrics = (await s.client.get("/metrics")).text
        assert "kvcache_offload_discarded_blocks_total 2.0" in metrics


async def test_released_blocks_go_first_when_room_is_needed_unless_used_again() -> None:
    async with make_engine(num_blocks=3) as engine:
        await engine.store(keys(1, 2, 3), [0, 1, 2])
        assert await engine.release(keys(1, 2, 9)) == 2  # 9 is absent
        assert (await engine.lookup(keys(1, 2))).hits == 2  # still loadable meanwhile
        await engine.touch(keys(1))  # asked for again: not dead after all
        result = await engine.store(keys(4, 5), [0, 1])
        # 2 (released) goes, and the policy's own choice among 1 and 3 (LRU: 3).
        assert sorted(key_ids(result.evicted_keys)) == [2, 3]
        assert engine.stats().released_evictions == 1


def test_a_refused_store_leaves_the_released_blocks_it_would_have_taken() -> None:
    manager = CPUOffloadingManager(2, "lru", enable_events=True)
    manager.prepare_store(keys(1, 2))
    manager.complete_store(keys(1, 2))
    manager.release(keys(1))
    list(manager.take_events())
    # Two slots needed: the released 1 goes, then the policy may not take 2 (this store's).
    assert manager.prepare_store(keys(2, 3, 4)) is None
    assert list(manager.take_events()) == []  # a refused store changes nothing
    assert manager.lookup(keys(1)[0]) is True
    out = manager.prepare_store(keys(3))  # one slot needed: the released block gives it
    assert out is not None and out.evicted_keys == keys(1)


async def test_release_over_http_and_through_the_client() -> None:
    async with served() as s:
        await store(s.client, [hex_key(1), hex_key(2)])
        r = await s.client.post("/v1/release", json={"keys": [hex_key(1), hex_key(7)]})
        assert r.status_code == 200, r.text
        assert r.json() == {"released": 1}
        transport = httpx.ASGITransport(app=s.app)
        async with OffloadClient("http://test", transport=transport) as client:
            assert await client.release([hex_key(2)]) == 1
        metrics = (await s.client.get("/metrics")).text
        assert "kvcache_offload_released_evictions_total 0.0" in metrics
        assert "kvcache_offload_released_blocks 2.0" in metrics


def test_release_marks_leave_with_their_blocks_however_they_go() -> None:
    # Marks are bounded by the blocks held: a block discarded, fenced or whose store failed
    # takes its mark along (a loop of release + discard over new keys kept every mark).
    manager = CPUOffloadingManager(4, "lru")
    manager.prepare_store(keys(1, 2, 3, 4))
    manager.complete_store(keys(1, 2, 3))  # 4 is still being written
    assert manager.release(keys(1, 2, 3, 4)) == 4
    assert manager.stats().released == 4
    assert manager.discard(keys(1)) == keys(1)
    manager.fence(keys(2))
    manager.complete_store(keys(4), success=False)
    assert manager.stats().released == 1  # only 3 is still held
    manager.touch(keys(3))  # used again: unmarked
    assert manager.stats().released == 0
    for i in range(10, 200):  # the abuse: release and discard new keys, forever
        manager.prepare_store(keys(i))
        manager.complete_store(keys(i))
        manager.release(keys(i))
        manager.discard(keys(i))
    assert manager.stats().released == 0
