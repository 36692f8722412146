"""A tier writer far behind (a slow object store) or a tier that is down must not slow stores.

Write-through copies a victim's bytes out on the loop when the writer has not reached it yet,
so no block is lost to eviction. When the write queue is already full, or the victim's write was
already dropped unread (no tier took writes), that copy would only be dropped: the store must
skip it (the drops are still counted).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import kvcache_offload.tiers as tiers_pkg
from kvcache_offload import KVCacheLayout, OffloadConfig
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.dataplane.memory.block_memory import BlockMemory
from kvcache_offload.errors import TierError
from kvcache_offload.tiers import SecondaryTier, TierStats
from tests.unit._aio_fakes import wait_for
from tests.unit._keys import keys

BLOCK = 4096


class StuckTier(SecondaryTier):
    """A tier whose writes hang until released: the writer stays behind."""

    def __init__(self) -> None:
        self.name = "stuck"
        self.release = asyncio.Event()
        self.writing = False

    async def contains(self, keys: Sequence[OffloadKey]) -> list[bool]:
        return [False] * len(keys)

    async def get(self, keys: Sequence[OffloadKey]) -> list[bytes | None]:
        return [None] * len(keys)

    async def put(self, items: Sequence[tuple[OffloadKey, bytes]]) -> None:
        self.writing = True
        await self.release.wait()

    async def delete(self, keys: Sequence[OffloadKey]) -> None:
        return None

    def stats(self) -> TierStats:
        return TierStats(self.name, "test")


def _count_reads_on_loop(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Block ids read from the CPU tier on this (the loop's) thread from now on."""
    loop_thread = threading.get_ident()
    reads_on_loop: list[int] = []
    for cls in [BlockMemory, *BlockMemory.__subclasses__()]:
        original = cls.read

        def read(self: Any, block_id: int, _original: Any = original) -> bytes:
            if threading.get_ident() == loop_thread:
                reads_on_loop.append(block_id)
            return bytes(_original(self, block_id))

        monkeypatch.setattr(cls, "read", read)
    return reads_on_loop


async def test_a_full_write_queue_costs_an_evicting_store_no_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = StuckTier()
    monkeypatch.setattr(tiers_pkg, "tiers_from_config", lambda cfg, fp: [tier], raising=False)
    reads_on_loop = _count_reads_on_loop(monkeypatch)
    cfg = OffloadConfig(
        cpu_bytes_to_use=2 * BLOCK,
        layout=KVCacheLayout(bytes_per_block=BLOCK),
        backend="cpu",
        eviction_policy="lru",
        disk_path=tmp_path,  # any tier setting: the tiers themselves are the stuck one
        tier_queue_size=1,
    )
    k0, k1, k2, k3 = keys(0, 1, 2, 3)
    async with OffloadEngine(cfg) as engine:
        try:
            await engine.write_blocks([k0], [bytes(BLOCK)])
            await wait_for(lambda: tier.writing, 5.0)  # the writer holds k0's job
            await engine.write_blocks([k1], [bytes(BLOCK)])  # queued: the queue is full
            await engine.write_blocks([k2], [bytes(BLOCK)])  # evicts k0, already read
            dropped = engine.stats().tiers[0].writes_dropped
            reads_on_loop.clear()
            await engine.write_blocks([k3], [bytes(BLOCK)])  # evicts k1, not written yet
            assert reads_on_loop == []
            # Both refused and counted: the victim k1, and k3's own write.
            assert engine.stats().tiers[0].writes_dropped == dropped + 2
        finally:
            tier.release.set()


class FailingTier(StuckTier):
    """A tier whose writes fail: the tier set backs it off and drops the next jobs unread."""

    async def put(self, items: Sequence[tuple[OffloadKey, bytes]]) -> None:
        raise TierError("down")


async def test_a_write_dropped_unread_costs_a_later_eviction_no_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = FailingTier()
    monkeypatch.setattr(tiers_pkg, "tiers_from_config", lambda cfg, fp: [tier], raising=False)
    reads_on_loop = _count_reads_on_loop(monkeypatch)
    cfg = OffloadConfig(
        cpu_bytes_to_use=2 * BLOCK,
        layout=KVCacheLayout(bytes_per_block=BLOCK),
        backend="cpu",
        eviction_policy="lru",
        disk_path=tmp_path,
    )
    k0, k1, k2, k3 = keys(0, 1, 2, 3)
    async with OffloadEngine(cfg) as engine:
        await engine.write_blocks([k0], [bytes(BLOCK)])
        await wait_for(lambda: engine.stats().tiers[0].errors == 1, 5.0)  # now backed off
        await engine.write_blocks([k1], [bytes(BLOCK)])
        await wait_for(lambda: engine.stats().tiers[0].writes_dropped == 2, 5.0)
        await engine.write_blocks([k2], [bytes(BLOCK)])  # evicts k0 (its write failed)
        reads_on_loop.clear()
        await engine.write_blocks([k3], [bytes(BLOCK)])  # evicts k1, whose job was dropped
        assert reads_on_loop == []
