"""A serving-like stream for the data-plane tests: many concurrent loads and stores, some
cancelled mid-await, every byte checked, nothing left pinned or in flight afterwards.

Shared by the CPU-backend test (runs everywhere) and the CUDA test (one run per mechanism).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import pytest
import torch

from kvcache_offload import KVCacheLayout, OffloadConfig, TransferTuning, make_offload_key
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.dataplane import layouts
from kvcache_offload.errors import CapacityError

TASKS = 16
JOB_BLOCKS = 4
JOBS_PER_TASK = 12


def key(task: int, job: int, i: int) -> OffloadKey:
    return make_offload_key(f"t{task}-j{job}-b{i}".encode(), 0)


def fill_blocks(tensors: list[torch.Tensor], blocks: list[int], seed: int) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for t in tensors:
        for b in blocks:
            raw = torch.randint(-128, 128, t[b].shape, dtype=torch.int8, generator=gen)
            t[b].copy_(raw.to(t.device))


def snapshot(tensors: list[torch.Tensor], blocks: list[int]) -> list[torch.Tensor]:
    return [t[b].clone() for b in blocks for t in tensors]


def build(
    device: str, mechanism: str = "auto", **config: Any
) -> tuple[OffloadEngine, list[torch.Tensor]]:
    """Per-layer blocks-first int8 tensors: 8 layers x 8 KiB fragments per block; ``config``:
    more :class:`OffloadConfig` fields."""
    num_gpu_blocks = 2 * TASKS * JOB_BLOCKS
    tensors = [
        torch.zeros((num_gpu_blocks, 2, 16, 8, 32), dtype=torch.int8, device=device)
        for _ in range(8)
    ]
    kv = layouts.blocks_first_per_layer(tensors)
    page = layouts.block_nbytes(kv)
    transfer = {"mechanism": mechanism, **config.pop("transfer", {})}
    transfer.update({k: config.pop(k) for k in list(config) if k in TransferTuning.model_fields})
    config = OffloadConfig(
        cpu_bytes_to_use=3 * TASKS * JOB_BLOCKS * page,
        transfer=transfer,
        **config,
        layout=KVCacheLayout(
            gpu_block_sizes=[16], bytes_per_block=page, num_gpu_blocks=num_gpu_blocks
        ),
    )
    return OffloadEngine(config, kv_caches=kv), tensors


async def run_stream(engine: OffloadEngine, tensors: list[torch.Tensor], seed: int = 0) -> int:
    """Each task stores a job from its store blocks, then loads it back into its load blocks
    and checks every byte; every fourth load is cancelled while it waits. Returns the number
    of loads checked."""
    rng = random.Random(seed)
    checked = 0

    async def task(t: int) -> None:
        nonlocal checked
        store_blocks = list(range(t * JOB_BLOCKS, (t + 1) * JOB_BLOCKS))
        load_blocks = [b + TASKS * JOB_BLOCKS for b in store_blocks]
        for j in range(JOBS_PER_TASK):
            fill_blocks(tensors, store_blocks, seed=hash((seed, t, j)) & 0xFFFF)
            want = snapshot(tensors, store_blocks)
            keys = [key(t, j, i) for i in range(JOB_BLOCKS)]
            try:
                await engine.store(keys, store_blocks)
            except CapacityError:
                await asyncio.sleep(0.001)
                continue
            await engine.touch(keys)
            if rng.random() < 0.25:
                load = asyncio.create_task(engine.load(keys, load_blocks))
                await asyncio.sleep(0)
                load.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await load
                # The cancelled load still runs to its end and releases its pins; the next
                # load into the same blocks is queued behind it, so the bytes are ours.
            await engine.load(keys, load_blocks)
            if tensors[0].is_cuda:
                torch.cuda.synchronize()
            got = snapshot(tensors, load_blocks)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), f"task {t} job {j}: loaded bytes differ"
            checked += 1

    async with asyncio.timeout(120):
        await asyncio.gather(*(task(t) for t in range(TASKS)))
    return checked


def assert_quiescent(engine: OffloadEngine) -> dict[str, Any]:
    """Nothing in flight, nothing pinned for reading or writing."""
    stats = engine.stats()
    assert stats.transfers_in_flight == 0
    assert stats.blocks_reading == 0
    assert stats.blocks_writing == 0
    return {"idle": stats.blocks_idle}


def record_looks(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Patch ``TransferPoller.submit_job`` (for the test's duration) to record, per job,
    whether its caller was asked to look for the copy's end itself (``LOOK``)."""
    from kvcache_offload.aio.poller import LOOK, TransferPoller

    submit_job = TransferPoller.submit_job
    looked: list[bool] = []

    def counted(self: TransferPoller, *args: Any) -> Any:
        future, mode = submit_job(self, *args)
        looked.append(mode == LOOK)
        return future, mode

    monkeypatch.setattr(TransferPoller, "submit_job", counted)
    return looked
