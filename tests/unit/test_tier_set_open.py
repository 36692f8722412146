"""Opening the tier set: every caller returns only once every tier is open."""

from __future__ import annotations

import asyncio

from kvcache_offload.tiers.tier_set import TierSet
from tests.unit._slow_tier import SlowTier


class SlowOpenTier(SlowTier):
    """A tier whose open (the object tier's listing, say) waits until the test lets it."""

    def __init__(self) -> None:
        super().__init__("slow-open")
        self.may_open = asyncio.Event()
        self.opened = False

    async def open(self) -> None:
        await self.may_open.wait()
        self.opened = True


async def test_a_second_open_waits_for_the_open_under_way() -> None:
    tier = SlowOpenTier()
    tiers = TierSet([tier])
    first = asyncio.create_task(tiers.open())
    await asyncio.sleep(0)  # the first open is now waiting inside the tier
    second = asyncio.create_task(tiers.open())
    await asyncio.sleep(0)
    assert not second.done(), "a second open returned before the tier was open"
    tier.may_open.set()
    await asyncio.wait_for(asyncio.gather(first, second), 5.0)
    assert tier.opened
    await tiers.open()  # and later opens return at once
