"""Layer-wise loads on the GPU: every byte lands, each layer's event orders a stream, and
nothing stays pinned after the job."""

from __future__ import annotations

import pytest
import torch

from kvcache_offload import make_offload_key
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.config import KVCacheLayout, OffloadConfig
from kvcache_offload.dataplane import layouts

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYERS, BLOCKS = 8, 64


@pytest.mark.parametrize("kv_first", [False, True])
async def test_layerwise_load_moves_every_byte_and_unpins(kv_first: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = (2, BLOCKS, 16, 8, 128) if kv_first else (BLOCKS, 2, 16, 8, 128)
    tensors = [
        torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda", generator=gen)
        for _ in range(LAYERS)
    ]
    kv = (layouts.kv_first_per_layer if kv_first else layouts.blocks_first_per_layer)(tensors)
    page = layouts.block_nbytes(kv)
    config = OffloadConfig(
        cpu_bytes_to_use=BLOCKS * page,
        layout=KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=page, num_gpu_blocks=BLOCKS),
    )
    keys = [make_offload_key(bytes([i + 1]) * 8, 0) for i in range(24)]
    src = list(range(0, 48, 2))
    dst = list(range(40, 64))

    def blocks(t: torch.Tensor, ids: list[int]) -> torch.Tensor:
        return t[:, ids] if kv_first else t[ids]

    async with OffloadEngine(config, kv_caches=kv) as engine:
        await engine.store(keys, src)
        torch.cuda.synchronize()
        want = [blocks(t, src).clone() for t in tensors]
        for t in tensors:
            if kv_first:
                t[:, dst] = 0
            else:
                t[dst] = 0
        handle = await engine.load_layerwise(keys, dst, refs_per_layer=2 if kv_first else 1)
        assert handle.num_layers == LAYERS
        stream = torch.cuda.Stream()
        sums = []
        with torch.cuda.stream(stream):
            for layer in range(LAYERS):
                handle.wait_layer(layer, stream)
                sums.append(blocks(tensors[layer], dst).clone())
        stream.synchronize()
        for layer in range(LAYERS):
            assert torch.equal(sums[layer], want[layer]), layer
        result = await handle.done()
        assert result.transfer_bytes == len(keys) * page
        stats = engine.stats()
        assert (stats.blocks_reading, stats.load_blocks_completed) == (0, len(keys))


async def test_a_lone_restore_sized_load_takes_the_kernel_not_the_submit_thread() -> None:
    """A 256 MiB load on an idle direction went to the staged path's submit thread, at
    2.0-2.8x the copy floor (docs/transfers.md, the auto rule)."""
    blocks = 136
    tensors = [torch.zeros((blocks, 2, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
               for _ in range(32)]  # fmt: skip
    kv = layouts.blocks_first_per_layer(tensors)
    page = layouts.block_nbytes(kv)
    config = OffloadConfig(
        cpu_bytes_to_use=blocks * page,
        layout=KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=page, num_gpu_blocks=blocks),
    )
    keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(128)]
    async with OffloadEngine(config, kv_caches=kv) as engine:
        await engine.store(keys, list(range(128)))
        handler = engine.worker.transfer_type_to_handler[("CPU", "GPU")]  # type: ignore[union-attr]
        before = dict(handler.jobs_by_mechanism)
        await engine.load(keys, list(range(128)))
        after = handler.jobs_by_mechanism
        assert after["kernel"] == before["kernel"] + 1
        assert after["staged"] == before["staged"]
