"""Layer-wise loads on the CPU backend: layers land in order, every byte, and a cancelled or
abandoned job leaves nothing pinned."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvcache_offload import make_offload_key
from kvcache_offload.aio import EventType, OffloadEngine
from kvcache_offload.config import KVCacheLayout, OffloadConfig
from kvcache_offload.dataplane import layouts
from kvcache_offload.dataplane.layer_copies import LayerCopier
from kvcache_offload.errors import ConfigError, TransferError

LAYERS = 4
BLOCKS = 16


def _engine() -> tuple[OffloadEngine, list[torch.Tensor]]:
    shape = (BLOCKS, 2, 16, 2, 32)
    gen = torch.Generator().manual_seed(5)
    tensors = [
        torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen) for _ in range(LAYERS)
    ]
    kv = layouts.blocks_first_per_layer(tensors)
    page = layouts.block_nbytes(kv)
    config = OffloadConfig(
        cpu_bytes_to_use=BLOCKS * page,
        layout=KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=page, num_gpu_blocks=BLOCKS),
    )
    return OffloadEngine(config, kv_caches=kv), tensors


def _keys(n: int) -> list[bytes]:
    return [make_offload_key(bytes([i + 1]) * 8, 0) for i in range(n)]


class _Gate:
    """Holds the copier's thread before each layer until the test lets that layer go."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.allowed = [threading.Event() for _ in range(LAYERS)]
        self.started: list[int] = []
        original = LayerCopier.start

        def start(copier: LayerCopier, spec, refs_per_layer=1):  # type: ignore[no-untyped-def]
            copy = copier._host_copy
            assert copy is not None
            counter = iter(range(LAYERS))

            def gated(plan):  # type: ignore[no-untyped-def]
                i = next(counter)
                self.started.append(i)
                assert self.allowed[i].wait(10), f"layer {i} never allowed"
                copy(plan)

            copier._host_copy = gated
            try:
                return original(copier, spec, refs_per_layer)
            finally:
                copier._host_copy = copy

        monkeypatch.setattr(LayerCopier, "start", start)


async def _until(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout)


async def test_layers_land_in_order_and_each_is_complete_when_reported(monkeypatch) -> None:
    gate = _Gate(monkeypatch)
    engine, tensors = _engine()
    keys = _keys(3)
    src, dst = [0, 1, 2], [7, 8, 9]
    async with engine:
        await engine.store(keys, src)
        want = [t[src].clone() for t in tensors]
        for t in tensors:
            t[dst] = 0
        handle = await engine.load_layerwise(keys, dst)
        assert handle.num_layers == LAYERS
        assert handle.num_bytes == LAYERS * 3 * tensors[0][0].numel()
        for layer in range(LAYERS):
            assert not any(handle.layer_done(i) for i in range(layer, LAYERS))
            gate.allowed[layer].set()
            await asyncio.to_thread(handle.wait_layer, layer)
            assert all(handle.layer_done(i) for i in range(layer + 1))
            assert torch.equal(tensors[layer][dst], want[layer])
            for later in range(layer + 1, LAYERS):
                assert not tensors[later][dst].any()  # not copied yet
        result = await handle.done()
        assert result.keys_loaded == keys
        assert result.transfer_bytes == handle.num_bytes
        assert gate.started == list(range(LAYERS))
        stats = engine.stats()
        assert (stats.blocks_reading, stats.load_blocks_completed) == (0, 3)
        kinds = [e.type for e in engine.event_hub.recent(0)]
        assert kinds[-1] == EventType.LOAD_COMPLETED


async def test_every_byte_matches_a_whole_job_load() -> None:
    engine, tensors = _engine()
    keys = _keys(5)
    async with engine:
        await engine.store(keys, [3, 1, 4, 15, 9])
        want = [t[[3, 1, 4, 15, 9]].clone() for t in tensors]
        for t in tensors:
            t[[10, 11, 12, 13, 14]] = -1
        handle = await engine.load_layerwise(keys, [10, 11, 12, 13, 14])
        for layer in range(handle.num_layers):
            handle.wait_layer(layer)
        await handle.done()
        for t, w in zip(tensors, want, strict=True):
            assert torch.equal(t[[10, 11, 12, 13, 14]], w)
        # The untouched blocks kept their bytes.
        assert all(int(t[10:15].ne(-1).sum()) > 0 for t in tensors)


async def test_cancel_mid_job_copies_no_further_layer_and_unpins(monkeypatch) -> None:
    gate = _Gate(monkeypatch)
    engine, tensors = _engine()
    keys = _keys(2)
    async with engine:
        await engine.store(keys, [0, 1])
        for t in tensors:
            t[[5, 6]] = 0
        handle = await engine.load_layerwise(keys, [5, 6])
        gate.allowed[0].set()
        await asyncio.to_thread(handle.wait_layer, 0)
        assert engine.stats().blocks_reading == 2  # pinned while the job runs
        handle.cancel()
        gate.allowed[1].set()  # the layer already waiting may finish; none after it starts
        with pytest.raises(TransferError, match="did not complete"):
            await handle.done()
        assert gate.started in ([0, 1], [0])
        with pytest.raises(TransferError, match="not copied"):
            handle.wait_layer(LAYERS - 1)
        assert not tensors[LAYERS - 1][[5, 6]].any()
        stats = engine.stats()
        assert (stats.blocks_reading, stats.load_blocks_failed) == (0, 2)
        # The keys stay loadable: a whole-job load after the cancelled one works.
        for gate_event in gate.allowed:
            gate_event.set()
        assert (await engine.load(keys, [5, 6])).keys_loaded == keys


async def test_cancelling_the_waiter_leaves_the_job_to_finish_and_unpin(monkeypatch) -> None:
    gate = _Gate(monkeypatch)
    engine, _ = _engine()
    keys = _keys(2)
    async with engine:
        await engine.store(keys, [0, 1])
        handle = await engine.load_layerwise(keys, [5, 6])
        waiter = asyncio.create_task(handle.done())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert engine.stats().blocks_reading == 2
        for event in gate.allowed:
            event.set()
        await _until(lambda: engine.stats().blocks_reading == 0)
        assert engine.stats().load_blocks_completed == 2


async def test_closing_the_engine_waits_for_the_layerwise_job(monkeypatch) -> None:
    gate = _Gate(monkeypatch)
    engine, _ = _engine()
    keys = _keys(2)
    await engine.store(keys, [0, 1])
    handle = await engine.load_layerwise(keys, [5, 6])
    closing = asyncio.create_task(engine.aclose())
    await asyncio.sleep(0)
    for event in gate.allowed:
        event.set()
    await closing
    assert (await handle.done()).keys_loaded == keys


async def test_unknown_keys_pin_nothing_and_bad_layer_split_is_a_config_error() -> None:
    engine, _ = _engine()
    keys = _keys(2)
    async with engine:
        await engine.store(keys, [0, 1])
        with pytest.raises(ConfigError, match="do not split into layers of 3"):
            await engine.load_layerwise(keys, [5, 6], refs_per_layer=3)
        assert engine.stats().blocks_reading == 0
        handle = await engine.load_layerwise(keys, [5, 6], refs_per_layer=2)
        assert handle.num_layers == LAYERS // 2
        await handle.done()
        with pytest.raises(ConfigError, match="out of range"):
            handle.wait_layer(LAYERS // 2)
        assert engine.stats().blocks_reading == 0
