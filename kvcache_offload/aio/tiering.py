"""EngineTiers: what the engine does with its secondary tiers, kept out of the engine itself.

The engine calls these hooks and nothing else; each is a no-op cost when no tier is configured
(the engine then holds no ``EngineTiers`` at all):

* :meth:`on_prepared` (a store was prepared): notes the CPU slot of each key to store; a
  victim the store evicted whose bytes have not gone down yet (write-back: any victim;
  write-through: one the writer has not reached) is copied out now, before the evicting store
  overwrites its slot, and queued. So a lagging writer never loses a block to eviction, and
  the queue holds no pins on the CPU tier. :meth:`on_store_failed` forgets the slots.
* :meth:`on_stored` (a store completed): write-through queues the keys, and the writer reads
  their bytes from the CPU tier when it gets to them, without pinning them (a tier write never
  takes CPU capacity away from stores); write-back keeps the slots for :meth:`on_prepared`.
* :meth:`extend_lookup` (a lookup's ready prefix stopped short): asks the tiers about the keys
  the CPU tier lacks, in one batch, and extends the prefix across tiers
  (:mod:`~kvcache_offload.aio.tier_lookup`).
* :meth:`promote` (before a load): copies keys held only below into CPU slots, so the load
  that follows is an ordinary CPU->GPU load; each chunk of keys is written as soon as it
  arrives, while the rest downloads. Concurrent promotions of one key share the work.
* :meth:`on_reset`: forgets the slot map.
* :meth:`needs_room` / :meth:`wait_for_room` (write-through with ``tier_write_backpressure``):
  a store waits for room in the write queue before it starts, so its write is not dropped.
  Room a store waited for is not taken back by stores already running, so the queue then
  holds up to twice ``tier_queue_size`` jobs; only a store whose wait timed out can find it
  full and have its write dropped (counted).

Blocks promoted from a tier are not written back down (the tiers already hold them).

A queued write reads only a slot that still holds its key's bytes: every slot hand-out passes
:meth:`on_prepared`, which reports it to the slot fence
(:class:`~kvcache_offload.aio.tier_slots.PendingSlots`), whatever freed the slot before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Literal, cast

import anyio

from kvcache_offload.aio.tier_lookup import CPU_TIER, cpu_answer, lookup_below
from kvcache_offload.aio.tier_slots import PendingSlots
from kvcache_offload.aio.types import LookupResult
from kvcache_offload.contracts.load_store_spec import BlockIDsLoadStoreSpec
from kvcache_offload.contracts.manager import OffloadingManager, ReqContext
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError
from kvcache_offload.tiers.tier_set import TierSet

if TYPE_CHECKING:
    from kvcache_offload.dataplane.memory.block_memory import BlockMemory

__all__ = ["CPU_TIER", "EngineTiers"]

logger = logging.getLogger(__name__)

_CTX = ReqContext()
_PROMOTE_ATTEMPTS = 4
_PROMOTE_CHUNK = 4
"""Keys per fetch of a promotion: each chunk is copied into CPU slots while later ones
download (4 blocks of 2 MiB: ~8 ms of copy left after the last byte arrives on a slow VM)."""
_CLOSE_DRAIN_S = 5.0
"""A slow tier must not hold a shutdown for long: writes still queued then are dropped."""

WriteBlocks = Callable[[list[OffloadKey], list[bytes]], Awaitable[object]]


def _ids(spec: object) -> list[int]:
    if isinstance(spec, BlockIDsLoadStoreSpec):
        return [int(b) for b in spec.block_ids]
    raise ConfigError(f"the manager returned {type(spec).__name__}, not a block-id spec")


async def _never_read() -> list[tuple[OffloadKey, bytes]]:
    """The source of a write the tier set refuses: it is never called."""
    return []


class EngineTiers:
    """The engine's side of tiering; see the module docstring."""

    def __init__(
        self,
        tier_set: TierSet,
        manager: OffloadingManager,
        block_memory: Callable[[], Awaitable[BlockMemory]],
        write_blocks: WriteBlocks,
        write_mode: Literal["through", "back"] = "through",
    ) -> None:
        self.tier_set = tier_set
        self.write_mode = write_mode
        self._manager = manager
        self._get_memory = block_memory
        self._write_blocks = write_blocks
        self._memory: BlockMemory | None = None
        self._pending = PendingSlots()
        """The CPU slot of each key whose bytes have not been handed to the tiers yet."""
        self._promoting: dict[OffloadKey, asyncio.Future[None]] = {}
        self._parked: dict[OffloadKey, bytes] = {}
        """Bytes of evicted keys queued for the tiers and not written yet: lookups and
        promotions find them here, so a key is never held nowhere between its eviction and
        its write landing."""
        self._from_tier: set[OffloadKey] = set()
        self.promoted_blocks = 0
        self.backpressure_s: float | None = None
        """With ``tier_write_backpressure``: the longest a store waits for room."""
        self.backpressure_waits = 0
        """Stores that found the write queue full and waited for room."""
        self.backpressure_timeouts = 0
        """Stores whose wait for room timed out (they went on; their write may be dropped)."""

    async def open(self) -> None:
        """Idempotent; the engine calls it on start, and every async hook makes sure of it."""
        if self._memory is None:
            self._memory = await self._get_memory()
        await self.tier_set.open()

    async def run(self) -> None:
        await self.open()
        await self.tier_set.run()

    async def aclose(self, drain_timeout_s: float) -> None:
        """Let queued writes finish (at most ``_CLOSE_DRAIN_S``), then close the tiers."""
        if not await self.tier_set.drain(min(drain_timeout_s, _CLOSE_DRAIN_S)):
            logger.warning("closed with %d tier writes still queued", self.tier_set.queue_depth)
        await self.tier_set.aclose()

    # -- writes ------------------------------------------------------------------------------

    def on_prepared(
        self,
        keys_to_store: Sequence[OffloadKey],
        store_spec: object,
        evicted_keys: Sequence[OffloadKey],
    ) -> None:
        """A store was prepared: note its slots, and save victims not yet written below."""
        if evicted_keys:
            self._save_victims(evicted_keys)
        if keys_to_store:
            handed_out = self._pending.handed_out
            for key, slot in zip(keys_to_store, _ids(store_spec), strict=True):
                handed_out(key, slot)

    def on_store_failed(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            self._pending.failed(key)

    def on_stored(self, keys: Sequence[OffloadKey]) -> None:
        fresh: list[OffloadKey] = []
        pending = self._pending
        for key in keys:
            if key in self._from_tier:
                pending.unprepare(key)
            elif pending.stored(key):
                fresh.append(key)
        if not fresh or self.write_mode != "through":
            return
        offered = [(k, held) for k in fresh if (held := pending.get(k)) is not None]
        read = False

        async def source() -> list[tuple[OffloadKey, bytes]]:
            nonlocal read
            read = True
            return await self._read_cpu(fresh)

        def ended() -> None:
            # A job the writer dropped unread (no tier took writes) leaves its keys' slots
            # here; forget them, or each would be copied out on the loop again at eviction,
            # for a write that no tier takes either.
            if not read:
                for key, held in offered:
                    if pending.holds(key, held):
                        pending.forget(key)

        limit = None if self.backpressure_s is None else 2 * self.tier_set.queue_size
        if not self.tier_set.offer(len(fresh), source, ended, limit=limit):
            for key in fresh:  # dropped (counted by the tier set)
                pending.forget(key)

    def needs_room(self, keys: Sequence[OffloadKey]) -> bool:
        """True when a store of ``keys`` must first :meth:`wait_for_room` (backpressure)."""
        return (
            self.backpressure_s is not None
            and self.tier_set.full
            and self.write_mode == "through"
            and not self._from_tier.issuperset(keys)
        )

    async def wait_for_room(self) -> None:
        if self.backpressure_s is None:
            return
        self.backpressure_waits += 1
        if not await self.tier_set.wait_for_room(self.backpressure_s):
            self.backpressure_timeouts += 1

    async def _read_cpu(self, keys: list[OffloadKey]) -> list[tuple[OffloadKey, bytes]]:
        """Bytes of the keys still in the CPU tier, read without pinning them.

        The copy runs in a worker thread while the CPU tier goes on; a key evicted meanwhile
        was already copied out by :meth:`_save_victims` (the slot fence drops it from here
        on), so its possibly overwritten bytes from here are dropped.
        """
        memory = self._memory or await self._get_memory()
        pending = self._pending
        todo = []
        for k in dict.fromkeys(keys):
            held = pending.get(k)
            if held is not None:
                todo.append((k, held))
        if not todo:
            return []
        # read_view: one copy, without the GIL (a GIL-held copy here stalls the loop).
        data = await anyio.to_thread.run_sync(
            lambda: [cast(bytes, memory.read_view(h[0])) for _, h in todo]
        )
        out = []
        for (key, held), blob in zip(todo, data, strict=True):
            if pending.holds(key, held):  # again: the slot may have changed hands meanwhile
                pending.forget(key)  # handed to the tiers
                out.append((key, blob))
        return out

    def _save_victims(self, keys: Sequence[OffloadKey]) -> None:
        pending = self._pending
        if not pending:
            return
        memory = self._memory
        held = [(k, h) for k in keys if (h := pending.get(k)) is not None]
        for key in keys:
            pending.forget(key)
        if not held or memory is None:
            return
        tier_set = self.tier_set
        if tier_set.queue_depth >= tier_set.queue_size:
            # The write queue is full, so the copy would be dropped: refuse it (counted) without
            # copying. A writer far behind (a slow object store) otherwise cost every evicting
            # store a copy of its victims on the loop, for nothing.
            tier_set.offer(len(held), _never_read)
            return
        # On the loop on purpose: the evicting store reuses the slot right after.
        items = [(k, cast(bytes, memory.read_view(h[0]))) for k, h in held]
        if items:
            parked = self._parked
            parked.update(items)

            async def source() -> list[tuple[OffloadKey, bytes]]:
                return items

            def landed() -> None:  # written below, or dropped: either way no longer ours
                for key, blob in items:
                    if parked.get(key) is blob:
                        del parked[key]

            if not self.tier_set.offer(len(items), source, landed):
                landed()

    def on_reset(self) -> None:
        self._pending.clear()
        self._parked.clear()

    # -- reads -------------------------------------------------------------------------------

    cpu_answer = staticmethod(cpu_answer)

    async def extend_lookup(
        self, keys: Sequence[OffloadKey], cpu: LookupResult, *, prefix_only: bool
    ) -> LookupResult:
        """The CPU answer extended across tiers, with the tier of each key."""
        if cpu.pending or cpu.hits >= len(keys):
            return cpu_answer(cpu)
        await self.tier_set.open()
        return await lookup_below(
            self.tier_set, self._manager, self._parked, keys, cpu, prefix_only=prefix_only
        )

    def holds_all(self, keys: Sequence[OffloadKey]) -> bool:
        """True when the CPU tier has every key (ready or being written): nothing to promote.

        A load's common case, answered without the coroutine of :meth:`promote`, so an idle
        tier costs a load a few dictionary lookups."""
        lookup = self._manager.lookup
        for key in keys:  # noqa: SIM110 - a loop: all() over a generator costs more per call
            if lookup(key, _CTX) is False:
                return False
        return True

    async def promote(self, keys: Sequence[OffloadKey]) -> None:
        """Bring keys held only below into CPU slots; keys no tier holds are left alone.

        Returns with every promotable key ready in the CPU tier (no await after the last
        check), so a caller's synchronous ``prepare_load`` right after cannot miss them.
        """
        await self.open()
        lookup = self._manager.lookup
        nowhere: set[OffloadKey] = set()
        for _ in range(_PROMOTE_ATTEMPTS):
            missing = [
                k for k in dict.fromkeys(keys) if k not in nowhere and lookup(k, _CTX) is False
            ]
            if not missing:
                return
            own = [k for k in missing if k not in self._promoting]
            waits = [self._promoting[k] for k in missing if k in self._promoting]
            if own:
                nowhere.update(await self._promote_own(own))
            if waits:
                await asyncio.gather(*waits, return_exceptions=True)
        # Still missing after several rounds (evicted again at once): the caller's
        # prepare_load reports the key as not ready, as for any CPU-only miss.

    async def _promote_own(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Fetch and write ``keys`` into CPU slots; returns the keys no tier could deliver.

        The fetch is asked for in chunks of ``_PROMOTE_CHUNK`` keys, all at once (each tier
        bounds its own requests in flight), and each chunk is written into CPU slots as soon
        as it arrives, so the copies overlap the rest of the fetch rather than following it.
        """
        loop = asyncio.get_running_loop()
        futures = {k: loop.create_future() for k in keys}
        self._promoting.update(futures)
        fetches: list[asyncio.Future[dict[OffloadKey, tuple[bytes, str]]]] = []
        try:
            parked = self._parked
            got = {k: (parked[k], "parked") for k in keys if k in parked}
            rest = [k for k in keys if k not in got]
            get = self.tier_set.get
            fetches = [
                asyncio.ensure_future(get(rest[i : i + _PROMOTE_CHUNK]))
                for i in range(0, len(rest), _PROMOTE_CHUNK)
            ]
            if got:
                await self._write_fetched(keys, got)
            for fetch in fetches:
                chunk = await fetch
                got.update(chunk)
                await self._write_fetched(keys, chunk)
            return [k for k in keys if k not in got]
        finally:
            for fetch in fetches:  # cancelled or failed part-way: no fetch outlives the call
                fetch.cancel()
            for key, fut in futures.items():
                if self._promoting.get(key) is fut:
                    del self._promoting[key]
                if not fut.done():
                    fut.set_result(None)

    async def _write_fetched(
        self, keys: list[OffloadKey], got: dict[OffloadKey, tuple[bytes, str]]
    ) -> None:
        """Write the fetched keys still absent from the CPU tier into CPU slots, in order."""
        lookup = self._manager.lookup
        fetched = [k for k in keys if k in got and lookup(k, _CTX) is False]
        if not fetched:
            return
        self._from_tier.update(fetched)
        try:
            await self._write_blocks(fetched, [got[k][0] for k in fetched])
        finally:
            self._from_tier.difference_update(fetched)
        self.promoted_blocks += len(fetched)
