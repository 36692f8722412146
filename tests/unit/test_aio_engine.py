"""OffloadEngine against a controllable fake handler: semantics, failures, leases, lifecycle."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvcache_offload.aio import EngineEvent, EventType, KeyState, OffloadEngine
from kvcache_offload.errors import (
    BlockStateError,
    CapacityError,
    ConfigError,
    LeaseError,
    OffloadError,
    TransferError,
)
from tests.unit._aio_fakes import BLOCK_BYTES, NO_KV, FakeHandler, FakeSpec, small_config, wait_for
from tests.unit._keys import key_ids, keys


def make_engine(
    num_blocks: int = 8, handler: FakeHandler | None = None, kv: bool = True, **kw: Any
) -> OffloadEngine:
    config = small_config(num_blocks, **kw.pop("config", {}))
    spec = FakeSpec(config, handler)
    return OffloadEngine(config, spec=spec, kv_caches=NO_KV if kv else None, **kw)


def events_of(engine: OffloadEngine) -> list[EngineEvent]:
    return engine.event_hub.recent(0)


async def test_lookup_reports_ready_prefix_and_pending_before_first_absent() -> None:
    async with make_engine() as engine:
        await engine.store(keys(1, 2), [10, 11])
        lease = await engine.prepare_store(keys(3))  # key 3 is being written
        result = await engine.lookup(keys(1, 2, 3, 4, 5))
        assert result.hits == 2
        assert result.pending is True
        assert result.states == [
            KeyState.READY, KeyState.READY, KeyState.WRITING, KeyState.ABSENT, KeyState.ABSENT,
        ]  # fmt: skip
        assert (await engine.lookup(keys(1, 4, 3))).pending is False  # writing after absent
        await engine.complete_store(lease.lease_id)
        assert (await engine.lookup(keys(1, 2, 3, 4))).hits == 3
        stats = engine.stats()
        assert (stats.lookups, stats.lookup_keys, stats.lookup_hit_blocks) == (3, 12, 2 + 1 + 3)


async def test_store_then_load_round_trip_publishes_stored_and_load_completed() -> None:
    handler = FakeHandler()
    async with make_engine(handler=handler) as engine:
        result = await engine.store(keys(1, 2, 3), [5, 6, 7])
        assert result.keys_stored == keys(1, 2, 3)
        assert result.transfer_bytes == 3 * BLOCK_BYTES
        again = await engine.store(keys(1, 2, 3, 4), [5, 6, 7, 8])
        assert again.keys_stored == keys(4)
        gpu_spec = handler.submitted[-1][1][0]
        assert list(gpu_spec.block_ids) == [8]  # only the new key's GPU block is copied
        loaded = await engine.load(keys(2, 3), [20, 21])
        assert loaded.keys_loaded == keys(2, 3)
        src, dst = handler.submitted[-1][1]
        assert (src.medium(), dst.medium(), list(dst.block_ids)) == ("CPU", "GPU", [20, 21])
        types = [e.type for e in events_of(engine)]
        assert types == [EventType.STORED, EventType.STORED, EventType.LOAD_COMPLETED]
        stats = engine.stats()
        assert stats.store_blocks_completed == 4 and stats.load_blocks_completed == 2
        assert stats.blocks_reading == 0 and stats.blocks_writing == 0
        assert stats.transfer_bytes == {
            "gpu_to_cpu": 4 * BLOCK_BYTES,
            "cpu_to_gpu": 2 * BLOCK_BYTES,
        }
        assert stats.transfer_duration["gpu_to_cpu"].count == 2


async def test_store_without_kv_caches_is_a_config_error() -> None:
    async with make_engine(kv=False) as engine:
        with pytest.raises(ConfigError, match="no KV caches registered"):
            await engine.store(keys(1), [0])


async def test_wrong_number_of_gpu_blocks_rolls_the_store_back() -> None:
    async with make_engine() as engine:
        with pytest.raises(ConfigError):
            await engine.store(keys(1, 2), [0])
        assert (await engine.lookup(keys(1))).states == [KeyState.ABSENT]
        assert engine.stats().blocks_writing == 0


async def test_store_with_no_evictable_room_raises_capacity_error() -> None:
    async with make_engine(num_blocks=2) as engine:
        await engine.prepare_store(keys(1, 2))
        with pytest.raises(CapacityError):
            await engine.store(keys(3), [0])
        assert engine.stats().stores_rejected == 1


async def test_eviction_events_precede_the_stored_event() -> None:
    async with make_engine(num_blocks=2, config={"eviction_policy": "lru"}) as engine:
        await engine.store(keys(1, 2), [0, 1])
        result = await engine.store(keys(3), [2])
        assert result.evicted_keys == keys(1)
        evs = events_of(engine)
        assert [(e.type, key_ids(e.keys)) for e in evs[-2:]] == [
            (EventType.EVICTED, [1]),
            (EventType.STORED, [3]),
        ]
        assert [e.seq for e in evs] == list(range(1, len(evs) + 1))
        assert engine.stats().evicted_blocks == 1


async def test_failed_transfer_rolls_back_emits_store_failed_and_raises() -> None:
    handler = FakeHandler()
    handler.fail_all = True
    async with make_engine(handler=handler) as engine:
        with pytest.raises(TransferError):
            await engine.store(keys(1, 2), [0, 1])
        assert (await engine.lookup(keys(1, 2))).states == [KeyState.ABSENT] * 2
        stats = engine.stats()
        assert stats.blocks_writing == 0 and stats.blocks_free == 8
        assert stats.store_blocks_failed == 2
        assert events_of(engine)[-1].type == EventType.STORE_FAILED


async def test_refused_transfer_rolls_back_and_raises() -> None:
    handler = FakeHandler()
    handler.refuse = True
    async with make_engine(handler=handler) as engine:
        with pytest.raises(TransferError):
            await engine.store(keys(1), [0])
        assert engine.stats().blocks_free == 8
        await engine.prepare_load([])  # the engine is still usable


async def test_failed_load_unpins_and_raises() -> None:
    handler = FakeHandler()
    async with make_engine(handler=handler) as engine:
        await engine.store(keys(1), [0])
        handler.fail_all = True
        with pytest.raises(TransferError):
            await engine.load(keys(1), [3])
        stats = engine.stats()
        assert stats.blocks_reading == 0 and stats.load_blocks_failed == 1
        failed = events_of(engine)[-1]
        assert failed.type == EventType.LOAD_FAILED and failed.keys == keys(1)


async def test_loading_a_key_that_is_not_ready_raises_block_state_error() -> None:
    async with make_engine() as engine:
        with pytest.raises(BlockStateError):
            await engine.load(keys(9), [0])
        with pytest.raises(BlockStateError):
            await engine.prepare_load(keys(9))


async def test_cancelled_store_still_completes_when_the_copy_finishes() -> None:
    handler = FakeHandler(auto=False)
    async with make_engine(handler=handler) as engine:
        task = asyncio.create_task(engine.store(keys(1), [0]))
        await wait_for(lambda: handler.pending)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await engine.lookup(keys(1))).pending  # still being written
        handler.release()
        await wait_for(lambda: engine.stats().blocks_writing == 0)
        assert (await engine.lookup(keys(1))).hits == 1


async def test_cancelled_load_unpins_when_the_copy_finishes() -> None:
    handler = FakeHandler()
    async with make_engine(handler=handler) as engine:
        await engine.store(keys(1), [0])
        handler.auto = False
        task = asyncio.create_task(engine.load(keys(1), [0]))
        await wait_for(lambda: handler.pending)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.stats().blocks_reading == 1
        handler.release()
        await wait_for(lambda: engine.stats().blocks_reading == 0)


async def test_store_lease_completion_makes_keys_loadable() -> None:
    async with make_engine() as engine:
        lease = await engine.prepare_store(keys(1, 2))
        assert lease.keys_to_store == keys(1, 2) and lease.block_ids == [0, 1]
        assert await engine.complete_store(lease.lease_id) == keys(1, 2)
        assert (await engine.lookup(keys(1, 2))).hits == 2
        with pytest.raises(LeaseError):
            await engine.complete_store(lease.lease_id)


async def test_expired_store_lease_rolls_back_with_an_event() -> None:
    async with make_engine() as engine:
        sub = engine.subscribe(types=[EventType.LEASE_EXPIRED])
        lease = await engine.prepare_store(keys(1, 2), ttl_s=0.02)
        event = await asyncio.wait_for(sub.__anext__(), 5)
        assert isinstance(event, EngineEvent)
        assert event.detail["lease_id"] == lease.lease_id and event.detail["kind"] == "store"
        assert key_ids(event.keys) == [1, 2]
        stats = engine.stats()
        # The late client may still write its slots: fenced until the grace period is over.
        assert (stats.blocks_free, stats.blocks_fenced, stats.leases_active) == (6, 2, 0)
        assert stats.leases_expired == {"store": 1, "load": 0}
        assert (await engine.lookup(keys(1))).states == [KeyState.ABSENT]
        with pytest.raises(LeaseError, match="expired"):
            await engine.complete_store(lease.lease_id)


async def test_expired_load_lease_releases_the_pins_after_the_grace_period() -> None:
    async with make_engine(config={"lease_grace_s": 0.05}) as engine:
        await engine.store(keys(1), [0])
        sub = engine.subscribe(types=["lease_expired"])
        await engine.prepare_load(keys(1), ttl_s=0.02)
        assert engine.stats().blocks_reading == 1
        await asyncio.wait_for(sub.__anext__(), 5)
        await wait_for(lambda: engine.stats().blocks_reading == 0)  # the late reader's grace
        assert engine.stats().leases_expired["load"] == 1


async def test_load_lease_completion_unpins() -> None:
    async with make_engine() as engine:
        await engine.store(keys(1, 2), [0, 1])
        lease = await engine.prepare_load(keys(1, 2))
        assert lease.block_ids == [0, 1]
        assert engine.stats().blocks_reading == 2
        await engine.complete_load(lease.lease_id)
        assert engine.stats().blocks_reading == 0
        assert events_of(engine)[-1].type == EventType.LOAD_COMPLETED


async def test_write_blocks_then_read_block_returns_the_same_bytes() -> None:
    async with make_engine(kv=False) as engine:
        assert engine.block_nbytes == BLOCK_BYTES
        blobs = [bytes([i]) * BLOCK_BYTES for i in (1, 2)]
        result = await engine.write_blocks(keys(1, 2), blobs)
        assert result.keys_stored == keys(1, 2)
        assert await engine.read_block(keys(2)[0]) == blobs[1]
        assert await engine.read_block(keys(1)[0]) == blobs[0]
        again = await engine.write_blocks(keys(1), [b"\0" * BLOCK_BYTES])
        assert again.keys_stored == []  # already offloaded: not overwritten
        assert await engine.read_block(keys(1)[0]) == blobs[0]
        assert engine.stats().blocks_reading == 0


async def test_write_blocks_rejects_wrong_sizes_before_allocating() -> None:
    async with make_engine(kv=False) as engine:
        with pytest.raises(ConfigError):
            await engine.write_blocks(keys(1), [b"short"])
        assert engine.stats().store_blocks_prepared == 0


async def test_read_block_of_absent_key_raises_block_state_error() -> None:
    async with make_engine(kv=False) as engine:
        with pytest.raises(BlockStateError):
            await engine.read_block(keys(1)[0])


async def test_reset_rolls_back_leases_and_drops_everything() -> None:
    async with make_engine() as engine:
        await engine.store(keys(1), [0])
        lease = await engine.prepare_store(keys(2))
        await engine.reset()
        assert (await engine.lookup(keys(1, 2))).states == [KeyState.ABSENT] * 2
        # The open lease's slot stays fenced: its client may still be writing it.
        stats = engine.stats()
        assert (stats.blocks_free, stats.blocks_fenced, stats.leases_active) == (7, 1, 0)
        assert events_of(engine)[-1].type == EventType.RESET
        with pytest.raises(LeaseError):
            await engine.complete_store(lease.lease_id)


async def test_aclose_waits_for_jobs_in_flight_and_completes_them() -> None:
    handler = FakeHandler(auto=False)
    engine = make_engine(handler=handler)
    await engine.start()
    store = asyncio.create_task(engine.store(keys(1), [0]))
    await wait_for(lambda: handler.pending)
    closing = asyncio.create_task(engine.aclose())
    await wait_for(lambda: engine.closed)
    handler.release()
    await asyncio.wait_for(closing, 5)
    assert (await store).keys_stored == keys(1)
    assert handler.shutdown_called
    with pytest.raises(OffloadError):
        await engine.store(keys(2), [0])
    await engine.aclose()  # idempotent


async def test_aclose_fails_jobs_that_never_finish_after_the_timeout() -> None:
    handler = FakeHandler(auto=False)
    engine = make_engine(handler=handler, close_timeout_s=0.05)
    await engine.start()
    store = asyncio.create_task(engine.store(keys(1), [0]))
    await wait_for(lambda: handler.pending)
    await asyncio.wait_for(engine.aclose(), 5)
    with pytest.raises(TransferError):
        await store


async def test_aclose_ends_event_subscriptions() -> None:
    engine = make_engine()
    await engine.start()
    sub = engine.subscribe()
    await engine.store(keys(1), [0])
    await engine.aclose()
    got = [e async for e in sub]
    assert [e.type for e in got] == [EventType.STORED]  # type: ignore[union-attr]


async def test_engine_works_without_entering_the_context_manager() -> None:
    engine = make_engine()
    try:
        assert (await engine.store(keys(1), [0])).keys_stored == keys(1)
    finally:
        await engine.aclose()


class Observer:
    def __init__(self) -> None:
        self.lookups: list[tuple[int, int]] = []
        self.stores: list[list[int]] = []

    def on_lookup(self, ks: Any, hits: int) -> None:
        self.lookups.append((len(ks), hits))

    def on_store(self, ks: Any) -> None:
        self.stores.append(key_ids(ks))

    def mrc_stats(self, capacity_blocks: int) -> tuple[dict[float, float], int]:
        return {1.0: 0.5, 2.0: float(capacity_blocks)}, 7


class BrokenObserver:
    def on_lookup(self, ks: Any, hits: int) -> None:
        raise RuntimeError("boom")

    def on_store(self, ks: Any) -> None:
        raise RuntimeError("boom")


async def test_access_observers_see_lookups_and_stores_and_fill_mrc_stats() -> None:
    obs = Observer()
    async with make_engine(access_observers=[BrokenObserver(), obs]) as engine:
        await engine.store(keys(1, 2), [0, 1])
        await engine.lookup(keys(1, 2, 3))
        await engine.prepare_store(keys(4))
        assert obs.lookups == [(3, 2)]
        assert obs.stores == [[1, 2], [4]]
        stats = engine.stats()
        assert stats.mrc_hit_ratio == {1.0: 0.5, 2.0: 8.0}
        assert stats.mrc_sampled_keys == 7


async def test_reuse_filter_skips_are_reported_in_stats() -> None:
    async with make_engine(config={"store_threshold": 2}) as engine:
        first = await engine.store(keys(1, 2), [0, 1])
        assert first.keys_stored == []
        second = await engine.store(keys(1, 2), [0, 1])
        assert second.keys_stored == keys(1, 2)
        assert engine.stats().reuse_filter_skipped_blocks == 2


async def test_concurrent_stores_and_loads_from_many_tasks_leave_nothing_pinned() -> None:
    async with make_engine(num_blocks=64) as engine:

        async def worker(i: int) -> None:
            ks = keys(i * 3, i * 3 + 1, i * 3 + 2)
            await engine.store(ks, [i, i + 1, i + 2])
            assert (await engine.lookup(ks)).hits == 3
            await engine.load(ks, [7, 8, 9])

        async with asyncio.timeout(10):
            await asyncio.gather(*(worker(i) for i in range(20)))
        stats = engine.stats()
        assert stats.store_blocks_completed == 60 and stats.load_blocks_completed == 60
        assert stats.blocks_reading == 0 and stats.blocks_writing == 0
        assert stats.transfers_in_flight == 0


async def test_prefix_only_lookup_stops_at_the_first_absent_key() -> None:
    async with make_engine() as engine:
        await engine.store(keys(1, 3), [0, 1])
        full = await engine.lookup(keys(1, 2, 3))
        short = await engine.lookup(keys(1, 2, 3), prefix_only=True)
        assert full.states == [KeyState.READY, KeyState.ABSENT, KeyState.READY]
        assert short.states == [KeyState.READY, KeyState.ABSENT]
        assert full.hits == short.hits == 1


def test_engine_runs_on_uvloop_like_under_uvicorn() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> list[EventType]:
        handler = FakeHandler(auto=False)
        async with make_engine(handler=handler) as engine:
            sub = engine.subscribe()
            store = asyncio.create_task(engine.store(keys(1), [0]))
            await wait_for(lambda: handler.pending)
            await asyncio.to_thread(handler.release)  # completion seen from another thread
            await asyncio.wait_for(store, 5)
            await engine.prepare_store(keys(2), ttl_s=0.01)
            types = []
            async for item in sub:
                assert isinstance(item, EngineEvent)
                types.append(item.type)
                if item.type == EventType.LEASE_EXPIRED:
                    break
            return types

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        types = runner.run(asyncio.wait_for(scenario(), 10))
    assert types == [EventType.STORED, EventType.LEASE_EXPIRED]


class Estimator:
    """An observer that estimates (reports a miss-ratio curve): the expensive kind."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_lookup(self, keys: Any, hits: int) -> None:
        self.seen.append(len(keys))

    def on_store(self, keys: Any) -> None:
        pass

    def mrc_stats(self, capacity_blocks: int) -> tuple[dict[float, float], int]:
        return {1.0: 0.0}, len(self.seen)


async def test_budgeted_estimators_run_off_the_request_path_and_catch_up_before_stats() -> None:
    est = Estimator()
    async with make_engine(access_observers=[est], observer_budget=0.5) as engine:
        await engine.lookup(keys(1, 2, 3))
        assert est.seen == []  # queued: the lookup did not wait for the estimator
        stats = engine.stats()
        assert est.seen == [3] and stats.mrc_sampled_keys == 1
        assert stats.observer_dropped_requests == 0


async def test_a_saturated_engine_sheds_estimator_work_and_counts_it() -> None:
    est = Estimator()
    async with make_engine(access_observers=[est], observer_budget=0.1) as engine:
        for _ in range(5000):  # no await in between: the estimators never get the loop
            engine.lookup_now(keys(1, 2))
        stats = engine.stats()
        assert stats.observer_dropped_requests > 0
        assert len(est.seen) + stats.observer_dropped_requests == 5000
