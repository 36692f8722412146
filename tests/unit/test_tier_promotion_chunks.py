"""A load of many blocks held below gets the first ones into the CPU tier while the rest download.

Fetching from an object store is the slow part of such a load; copying each block into its
CPU slot only after the last one arrived added the whole copy to the load's time. The blocks
that arrived are written into CPU slots while the tier still delivers the others, and the load
still returns every block byte-exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from kvcache_offload import KVCacheLayout, OffloadConfig
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.contracts.offload_key import OffloadKey
from tests.unit._aio_fakes import wait_for
from tests.unit._keys import keys
from tests.unit._slow_tier import SlowTier, unused_dir, use_tiers

BLOCK = 4096
N = 16


def fill(i: int) -> bytes:
    return bytes([i]) * BLOCK


class LastKeyLate(SlowTier):
    """Reads of a batch holding ``late`` wait until ``release`` is set."""

    def __init__(self, late: OffloadKey) -> None:
        super().__init__()
        self.late = late
        self.release = asyncio.Event()

    async def get(self, keys: Sequence[OffloadKey]) -> list[bytes | None]:
        if self.late in keys:
            await self.release.wait()
        return await super().get(keys)


async def test_blocks_that_arrived_are_in_the_cpu_tier_before_the_last_one_arrives(
    tmp_path: Path,
) -> None:
    config = OffloadConfig(
        cpu_bytes_to_use=2 * N * BLOCK,
        layout=KVCacheLayout(bytes_per_block=BLOCK),
        backend="cpu",
        disk_path=unused_dir(tmp_path),
    )
    ks = keys(*range(N))
    engine = OffloadEngine(config)
    tier = LastKeyLate(ks[-1])
    use_tiers(engine, tier)
    tier.blocks = {k: fill(i) for i, k in enumerate(ks)}
    async with engine:
        found = await engine.lookup(ks)
        assert found.tiers == ["slow"] * N
        loading = asyncio.ensure_future(engine.prepare_load(ks))

        async def in_cpu_tier() -> list[str | None]:
            return (await engine.lookup(ks)).tiers

        seen: list[str | None] = []

        def first_blocks_promoted() -> bool:
            return seen[:1] == ["CPU"]

        async def watch() -> None:
            while not first_blocks_promoted():
                await asyncio.sleep(0)  # a turn for the promotion; the lookup may not yield
                seen[:] = await in_cpu_tier()

        try:
            await asyncio.wait_for(watch(), 5.0)
            assert not loading.done()  # the last block is still on its way
        finally:
            tier.release.set()
        lease = await loading
        await engine.complete_load(lease.lease_id)
        assert [await engine.read_block(k) for k in ks] == [fill(i) for i in range(N)]
        await wait_for(lambda: engine.stats().tier_promoted_blocks == N)
