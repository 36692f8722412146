"""OffloadEngine over the CUDA handlers: bytes round-trip, concurrency, cancellation."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("kvcache_offload.dataplane.handlers.cuda")

from kvcache_offload import (  # noqa: E402
    KVCacheLayout,
    OffloadConfig,
    TransferTuning,
)
from kvcache_offload.aio import EventType, OffloadEngine  # noqa: E402
from kvcache_offload.dataplane import layouts  # noqa: E402
from kvcache_offload.errors import ConfigError, TransferError  # noqa: E402
from tests.unit._aio_fakes import wait_for  # noqa: E402
from tests.unit._keys import keys  # noqa: E402

pytestmark = pytest.mark.cuda

NUM_GPU_BLOCKS = 64


def build(num_cpu_blocks: int = 128, **config: Any) -> tuple[OffloadEngine, list[Any]]:
    tensors = [
        torch.randint(-128, 127, (NUM_GPU_BLOCKS, 2, 16, 8, 64), dtype=torch.int8, device="cuda")
        for _ in range(4)
    ]
    kv = layouts.blocks_first_per_layer(tensors)
    page = layouts.block_nbytes(kv)
    transfer = {k: config.pop(k) for k in list(config) if k in TransferTuning.model_fields}
    offload_config = OffloadConfig(
        cpu_bytes_to_use=num_cpu_blocks * page,
        transfer=transfer,
        layout=KVCacheLayout(
            gpu_block_sizes=[16], bytes_per_block=page, num_gpu_blocks=NUM_GPU_BLOCKS
        ),
        backend="cuda",
        **config,
    )
    return OffloadEngine(offload_config, kv_caches=kv), tensors


def block(tensors: list[Any], b: int) -> list[Any]:
    return [t[b].clone() for t in tensors]


async def test_concurrent_stores_then_loads_restore_the_exact_bytes() -> None:
    engine, tensors = build()
    async with engine:
        expected = {i: block(tensors, i) for i in range(32)}
        async with asyncio.timeout(60):
            await asyncio.gather(*(engine.store(keys(i), [i]) for i in range(32)))
        assert (await engine.lookup(keys(*range(32)))).hits == 32
        for t in tensors:
            t[32:].zero_()
        async with asyncio.timeout(60):
            await asyncio.gather(*(engine.load(keys(i), [32 + i]) for i in range(32)))
        torch.cuda.synchronize()
        for i in range(32):
            for got, want in zip(block(tensors, 32 + i), expected[i], strict=True):
                assert torch.equal(got, want), f"block {i} differs"
        stats = engine.stats()
        assert stats.blocks_reading == 0 and stats.blocks_writing == 0
        assert stats.transfer_duration["cpu_to_gpu"].count >= 1


@pytest.mark.parametrize("caller_looks", [True, False])
async def test_lone_jobs_one_after_another_restore_the_exact_bytes(caller_looks: bool) -> None:
    # One job at a time, as a lone request: its caller looks for the end itself (or, turned
    # off, the poller task does); either way the bytes and the pins come out right.
    engine, tensors = build(completion_caller_looks=caller_looks)
    async with engine:
        expected = {i: block(tensors, i) for i in range(8)}
        async with asyncio.timeout(60):
            for i in range(8):
                await engine.store(keys(i), [i])
            for t in tensors:
                t[32:].zero_()
            for i in range(8):
                await engine.load(keys(i), [32 + i])
        for i in range(8):
            for got, want in zip(block(tensors, 32 + i), expected[i], strict=True):
                assert torch.equal(got, want), f"block {i} differs"
        stats = engine.stats()
        assert stats.blocks_reading == 0 and stats.blocks_writing == 0
        poller = engine._poller
        assert poller is not None
        assert (poller.caller_finds > 0) is caller_looks


@pytest.mark.parametrize("blocks", [1, 8])
async def test_a_store_copies_what_the_model_wrote_on_the_default_stream(blocks: int) -> None:
    # A serving engine enqueues its forward pass on the current stream and stores the new
    # blocks right after, without waiting for the GPU: the store must copy what the model
    # writes, not what was there before. Default configuration, the default stream (raw
    # handle 0), several stores in a row (the first binds the kernel to the C issuer).
    engine, tensors = build()
    async with engine:
        async with asyncio.timeout(60):
            for round_ in range(4):
                first = (round_ * blocks) % 32
                ids = list(range(first, first + blocks))
                gpu_ids = torch.tensor(ids, device="cuda")
                torch.cuda.synchronize()
                torch.cuda._sleep(100_000_000)  # the "model", ~50 ms on the current stream
                for t in tensors:
                    t.index_fill_(0, gpu_ids, round_ + 1)  # no host copy: nothing waits
                stored = await engine.store(keys(*range(100 * round_, 100 * round_ + blocks)), ids)
                assert len(stored.keys_stored) == blocks
                for t in tensors:
                    t[48 : 48 + blocks].zero_()
                await engine.load(keys(*range(100 * round_, 100 * round_ + blocks)),
                                  list(range(48, 48 + blocks)))  # fmt: skip
                for t in tensors:
                    got = t[48 : 48 + blocks]
                    assert bool((got == round_ + 1).all()), f"store {round_} missed the model"


async def test_cancelled_load_still_unpins_when_the_copy_ends() -> None:
    engine, _ = build()
    async with engine:
        await engine.store(keys(*range(16)), list(range(16)))
        sub = engine.subscribe(types=[EventType.LOAD_COMPLETED])
        task = asyncio.create_task(engine.load(keys(*range(16)), list(range(16, 32))))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(sub.__anext__(), 30)
        await wait_for(lambda: engine.stats().blocks_reading == 0, 30)


async def test_aclose_with_jobs_in_flight_leaves_no_transfer_behind() -> None:
    engine, _ = build()
    await engine.start()
    tasks = [asyncio.create_task(engine.store(keys(i), [i])) for i in range(32)]
    await wait_for(lambda: any(t.done() for t in tasks) or engine.stats().transfers_in_flight)
    await asyncio.wait_for(engine.aclose(), 60)
    await asyncio.gather(*tasks, return_exceptions=True)
    assert engine.stats().transfers_in_flight == 0


async def test_the_config_sets_staged_when_busy_per_direction() -> None:
    expected = {
        "off": (False, False),
        "stores": (True, False),
        "both": (True, True),
        "mixed": (True, True),
    }
    for setting, (stores, loads) in expected.items():
        engine, _ = build(staged_when_busy=setting)
        async with engine:
            assert engine.worker is not None
            flags = {h.gpu_to_cpu: h.staged_when_busy for h in engine.worker.handlers}
            assert flags == {True: stores, False: loads}, setting
            paired = [h._other_direction is not None for h in engine.worker.handlers]
            assert paired == [setting == "mixed"] * 2, setting
    engine, _ = build()
    async with engine:  # the default: the copy engines only while both directions copy
        assert engine.worker is not None
        assert all(h.staged_when_busy for h in engine.worker.handlers)
        assert all(h._other_direction is not None for h in engine.worker.handlers)
        sizes = {h.gpu_to_cpu: h.one_way_min_job_bytes for h in engine.worker.handlers}
        assert sizes == {True: 8 << 20, False: 5 << 20}  # stores, loads
        lone = {h.gpu_to_cpu: h.staged_auto_min_job_bytes for h in engine.worker.handlers}
        assert lone == {True: 256 << 20, False: 32 << 20}
        assert [h.mixed_min_job_bytes for h in engine.worker.handlers] == [5 << 20] * 2
        assert engine._poller is not None and engine._poller.sleep_behind_s == 0.003
        assert engine._poller.on_demand  # the rule applies where the poller looks by itself
    engine, _ = build(
        staged_one_way_min_load_bytes="1MiB",
        staged_one_way_min_store_bytes=0,
        staged_mixed_min_job_bytes=0,
    )
    async with engine:  # large one-way jobs: the copy engines from this size on
        assert engine.worker is not None
        sizes = {h.gpu_to_cpu: h.one_way_min_job_bytes for h in engine.worker.handlers}
        assert sizes == {True: 0, False: 1 << 20}
        assert [h.mixed_min_job_bytes for h in engine.worker.handlers] == [0, 0]


async def test_the_config_sets_the_batch_bounds_of_both_directions() -> None:
    engine, _ = build()
    async with engine:
        assert engine.worker is not None
        bounds = {(h.batch_min_bytes, h.batch_max_bytes) for h in engine.worker.handlers}
        assert bounds == {(16 << 20, 64 << 20)}
    engine, _ = build(batch_min_bytes="8MiB", batch_max_bytes="8MiB")  # a fixed split
    async with engine:
        assert engine.worker is not None
        bounds = {(h.batch_min_bytes, h.batch_max_bytes) for h in engine.worker.handlers}
        assert bounds == {(8 << 20, 8 << 20)}


async def test_aclose_unpins_the_cpu_tier_at_once() -> None:
    """The pinned tier goes with aclose(), not with a later garbage collection: unpinning
    it synchronizes the device, and a collection that did so stalled other engines' copies."""
    import gc
    import weakref

    from kvcache_offload import make_offload_key

    engine, tensors = build()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        async with engine:
            keys = [make_offload_key(b"tier-%d" % i, 0) for i in range(4)]
            await engine.store(keys, [0, 1, 2, 3])
            await engine.load(keys, [4, 5, 6, 7])
            pair = engine.spec.build_handlers(layouts.blocks_first_per_layer(tensors))
            bases = {id(t._base): t._base for t in pair.cpu_tensors if t._base is not None}
            refs = [weakref.ref(b) for b in bases.values()]
            del pair, bases
            assert refs and all(r() is not None for r in refs)
        assert all(r() is None for r in refs), "the pinned CPU tier outlived aclose()"
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize("together", [False, True])
async def test_strided_id_views_store_and_load_the_right_blocks(together: bool) -> None:
    # A numpy view with a stride (every other block) is not a contiguous buffer: the C
    # paths refuse it and the job is planned the general way. Lone (the lone lane's
    # fallback) and four at once (held for a batch).
    engine, tensors = build()
    async with engine:
        expected = {b: block(tensors, b) for b in range(16)}
        sources = [np.arange(4 * j, 4 * j + 4)[::2] for j in range(4)]  # 0,2 / 4,6 / ...
        targets = [np.arange(32 + 4 * j, 32 + 4 * j + 4)[::2] for j in range(4)]
        stores = [engine.store(keys(2 * j, 2 * j + 1), sources[j]) for j in range(4)]
        async with asyncio.timeout(60):
            if together:
                await asyncio.gather(*stores)
            else:
                for store in stores:
                    await store
            for t in tensors:
                t[32:].zero_()
            loads = [engine.load(keys(2 * j, 2 * j + 1), targets[j]) for j in range(4)]
            if together:
                await asyncio.gather(*loads)
            else:
                for load in loads:
                    await load
        torch.cuda.synchronize()
        for j in range(4):
            for src, dst in zip(sources[j].tolist(), targets[j].tolist(), strict=True):
                for got, want in zip(block(tensors, dst), expected[src], strict=True):
                    assert torch.equal(got, want), f"block {src} -> {dst} differs"
            for skipped in (33 + 4 * j, 35 + 4 * j):  # between the view's blocks
                assert all(not bool(t[skipped].any()) for t in tensors)
        stats = engine.stats()
        assert stats.blocks_reading == 0 and stats.blocks_writing == 0


async def test_bad_gpu_block_ids_name_their_problem_and_leave_nothing_behind() -> None:
    engine, tensors = build()
    async with engine:
        async with asyncio.timeout(60):
            with pytest.raises(ConfigError, match="must be integers"):
                await engine.store(keys(0), [0.5])
            with pytest.raises(TransferError, match=r"block ids must be in \[0, 64\)"):
                await engine.store(keys(0), [NUM_GPU_BLOCKS])
            assert (await engine.lookup(keys(0))).hits == 0
            want = block(tensors, 3)
            await engine.store(keys(0), [3])
            with pytest.raises(TransferError, match=r"block ids must be in \[0, 64\)"):
                await engine.load(keys(0), [-1])
            with pytest.raises(ConfigError, match="must be integers"):
                await engine.load(keys(0), [True])
            for t in tensors:
                t[5].zero_()
            await engine.load(keys(0), [5])
        torch.cuda.synchronize()
        for got, expected in zip(block(tensors, 5), want, strict=True):
            assert torch.equal(got, expected)
        stats = engine.stats()
        assert stats.blocks_reading == 0 and stats.blocks_writing == 0
        assert stats.transfers_in_flight == 0


async def test_blocks_chosen_ahead_keep_their_bytes_until_a_store_takes_their_slots() -> None:
    # Lone stores into a full tier: behind each copy an LRU policy chooses the next store's
    # victims (2 of 64 blocks at the default fraction). Until a store takes them they load
    # byte-exact (a load puts the block back where LRU had it, the least recent: the engine's
    # load does not touch); the slot a store takes holds its new bytes.
    engine, tensors = build(num_cpu_blocks=64, eviction_policy="lru")
    async with engine:
        expected = {i: block(tensors, i) for i in range(NUM_GPU_BLOCKS)}
        async with asyncio.timeout(60):
            for start in range(0, 64, 8):
                await engine.store(keys(*range(start, start + 8)), list(range(start, start + 8)))
            manager: Any = engine.manager
            assert manager.stats().chosen_ahead == 2  # keys 0 and 1, LRU
            assert (await engine.lookup(keys(0, 1))).hits == 2

            await engine.load(keys(0), [63])  # back in the policy, still the least recent
            stored = await engine.store(keys(100, 101), [10, 11])
            # As at need: the two least recent, key 1 as chosen ahead, key 0 chosen again.
            assert sorted(stored.evicted_keys) == sorted(keys(0, 1))
            await engine.load(keys(100, 101), [60, 61])
        torch.cuda.synchronize()
        for got_block, want_block in ((63, 0), (60, 10), (61, 11)):
            for got, want in zip(block(tensors, got_block), expected[want_block], strict=True):
                assert torch.equal(got, want), f"GPU block {got_block} differs"
        stats = engine.stats()
        assert stats.evicted_ahead_blocks == 1
        assert stats.blocks_reading == 0 and stats.blocks_writing == 0
        assert (await engine.lookup(keys(0, 1))).hits == 0
