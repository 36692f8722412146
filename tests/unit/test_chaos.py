"""Bounded chaos: uploads, reads, sidecar stores and loads, late and killed writers, resets.

Every block's bytes are a function of its key, so any byte that a read returns for a key
and that belongs to another key is caught. Runs a fixed number of rounds (a few seconds).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from typing import Any

import anyio
import numpy as np

from kvcache_offload.aio import OffloadEngine
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import OffloadError
from tests.unit._api_app import BLOCK_BYTES, small_config

ROUNDS = 60


def key(i: int) -> OffloadKey:
    return OffloadKey(i.to_bytes(8, "big") + b"\0\0\0\0")


def content(k: OffloadKey) -> bytes:
    seed = hashlib.sha256(k).digest()
    return (seed * (BLOCK_BYTES // len(seed) + 1))[:BLOCK_BYTES]


def _write_into(memory: Any, slot: int, data: bytes) -> None:
    """A sidecar client's plain memory write into its slot (whole or part of the block)."""
    memory.rows[slot, : len(data)] = np.frombuffer(data, dtype=np.uint8)


async def test_no_read_ever_returns_another_keys_bytes() -> None:
    config = small_config(cpu_bytes_to_use=512 * BLOCK_BYTES, lease_grace_s=60)
    rng = random.Random(13)
    wrong: list[str] = []
    ok_reads = 0
    async with OffloadEngine(config) as engine:
        memory = await engine._get_block_memory()

        async def uploader(worker: int) -> None:
            for n in range(ROUNDS):
                if worker == 0 and n % 15 == 7:  # resets while copies and leases are open
                    await engine.reset()
                keys = list({key(rng.randrange(64)) for _ in range(rng.randint(1, 4))})
                with contextlib.suppress(OffloadError):
                    await engine.write_blocks(keys, [content(k) for k in keys])
                await anyio.sleep(0)

        async def reader(worker: int) -> None:
            nonlocal ok_reads
            for _ in range(ROUNDS * 2):
                await anyio.sleep(0.001)  # let the writers run between reads
                k = key(rng.randrange(64))
                try:
                    data = await engine.read_block(k)
                except OffloadError:
                    continue
                ok_reads += 1
                if data != content(k):
                    wrong.append(f"read_block {k.hex()}")

        async def sidecar_writer(worker: int) -> None:
            for n in range(ROUNDS):
                keys = [key(1000 + worker * 10_000 + n * 4 + j) for j in range(2)]
                late = n % 5 == 0  # sleeps past its TTL, then writes anyway
                killed = n % 7 == 0  # writes half a block, never completes
                try:
                    lease = await engine.prepare_store(keys, ttl_s=0.02 if late or killed else 5)
                except OffloadError:
                    continue
                if late:
                    await anyio.sleep(0.05)
                for k, slot in zip(lease.keys_to_store, lease.block_ids, strict=True):
                    data = content(k)[: BLOCK_BYTES // 2] if killed else content(k)
                    await anyio.to_thread.run_sync(_write_into, memory, slot, data)
                if killed:
                    continue
                with contextlib.suppress(OffloadError):
                    await engine.complete_store(lease.lease_id)

        async def sidecar_reader(worker: int) -> None:
            nonlocal ok_reads
            for _ in range(ROUNDS * 2):
                await anyio.sleep(0.001)
                k = key(1000 + rng.randrange(2) * 10_000 + rng.randrange(ROUNDS * 4))
                try:
                    lease = await engine.prepare_load([k], ttl_s=5)
                except OffloadError:
                    continue
                data = await anyio.to_thread.run_sync(memory.read, lease.block_ids[0])
                try:
                    await engine.complete_load(lease.lease_id)
                except OffloadError:
                    continue  # a reset took the lease: the copy is void
                ok_reads += 1
                if data != content(k):
                    wrong.append(f"sidecar load {k.hex()}")

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for w in range(2):
                    tg.start_soon(uploader, w)
                    tg.start_soon(reader, w)
                    tg.start_soon(sidecar_writer, w)
                    tg.start_soon(sidecar_reader, w)
    assert wrong == []
    assert ok_reads > 20  # the readers did read, concurrently with everything else
