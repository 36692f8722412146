"""A secondary tier in memory whose writes wait until the test lets them through.

It stands in for a disk or Redis tier that is slower than the CPU tier: the engine's write
queue backs up behind it, which is when a queued write must still read the right bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcache_offload.aio import OffloadEngine
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.tiers.base import SecondaryTier, TierStats
from kvcache_offload.tiers.tier_set import TierSet


class SlowTier(SecondaryTier):
    """Holds blocks in a dict; ``put`` waits while ``gate`` is closed."""

    def __init__(self, name: str = "slow") -> None:
        self.name = name
        self.blocks: dict[OffloadKey, bytes] = {}
        self.gate = asyncio.Event()
        self.gate.set()
        self.puts_waiting = 0
        self._stats = TierStats(name, "memory")

    async def contains(self, keys: Sequence[OffloadKey]) -> list[bool]:
        return [k in self.blocks for k in keys]

    async def get(self, keys: Sequence[OffloadKey]) -> list[bytes | None]:
        return [self.blocks.get(k) for k in keys]

    async def put(self, items: Sequence[tuple[OffloadKey, bytes]]) -> None:
        self.puts_waiting += 1
        try:
            await self.gate.wait()
        finally:
            self.puts_waiting -= 1
        for key, data in items:
            self.blocks[key] = bytes(data)
            self._stats.put_blocks += 1

    async def delete(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            self.blocks.pop(key, None)

    def stats(self) -> TierStats:
        return TierStats(**self._stats.__dict__)


def use_tiers(engine: OffloadEngine, *tiers: SecondaryTier, **tier_set: Any) -> TierSet:
    """Put ``tiers`` in place of the engine's configured ones (before it starts)."""
    assert engine._tiers is not None, "configure a tier (disk_path) so the engine has tiering"
    old = engine._tiers.tier_set
    new = TierSet(
        list(tiers),
        queue_size=tier_set.get("queue_size", old.queue_size),
        read_timeout_s=tier_set.get("read_timeout_s", 5.0),
        on_event=old._on_event,
    )
    engine._tiers.tier_set = new
    return new


def unused_dir(tmp_path: Path) -> str:
    """A disk_path that only switches tiering on (its tier is replaced before use)."""
    return str(tmp_path / "unused-disk")
