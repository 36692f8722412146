"""Closing an engine gives its CPU tier back at once, not at some later garbage collection."""

from __future__ import annotations

import gc
import weakref

import torch

from kvcache_offload import KVCacheLayout, OffloadConfig, make_offload_key
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.dataplane import layouts


async def test_aclose_releases_the_cpu_tier_while_the_engine_object_lives() -> None:
    layers = [torch.randn(32, 2, 16, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    kv = layouts.blocks_first_per_layer(layers)
    config = OffloadConfig(
        cpu_bytes_to_use=16 * layouts.block_nbytes(kv),
        backend="cpu",
        layout=KVCacheLayout(
            gpu_block_sizes=[16], bytes_per_block=layouts.block_nbytes(kv), num_gpu_blocks=32
        ),
    )
    engine = OffloadEngine(config, kv_caches=kv)
    was_enabled = gc.isenabled()
    gc.disable()  # only reference counting may free the tier
    try:
        async with engine:
            keys = [make_offload_key(b"block-%d" % i, 0) for i in range(4)]
            await engine.store(keys, gpu_blocks=[0, 1, 2, 3])
            await engine.load(keys, gpu_blocks=[4, 5, 6, 7])
            handlers = engine.spec.build_handlers(kv)
            tier = [t if t._base is None else t._base for t in handlers.cpu_tensors]
            refs = [weakref.ref(t) for t in tier]
            del handlers, tier
            assert all(r() is not None for r in refs)
        assert engine.closed
        assert all(r() is None for r in refs), "the CPU tier outlived aclose()"
    finally:
        if was_enabled:
            gc.enable()
