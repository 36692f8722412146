"""The manager steps every operation shares, and the counters they keep.

A store or load is the same four steps whoever moves the bytes (the engine's handlers, an
HTTP block transfer, a sidecar client under a lease): prepare with the manager, copy, complete
with the manager, publish what changed. The steps live here once; each also counts what it did
(``aio/engine_stats.py`` reads the counters) and tells the tiers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from kvcache_offload.aio.engine_base import EngineBase
from kvcache_offload.aio.types import EventType
from kvcache_offload.contracts.load_store_spec import BlockIDsLoadStoreSpec
from kvcache_offload.errors import CapacityError, ConfigError, OffloadError

if TYPE_CHECKING:
    from kvcache_offload.aio.leases import Lease
    from kvcache_offload.contracts.capabilities import EvictsAhead
    from kvcache_offload.contracts.handler import TransferResult
    from kvcache_offload.contracts.manager import PrepareStoreOutput, ReqContext
    from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["ManagerSteps", "block_ids_of"]

logger = logging.getLogger("kvcache_offload.aio.engine")

# The members, bound once: an attribute of an enum class costs ~0.25 us on Python 3.11, and
# every job publishes one to three events.
_STORED = EventType.STORED
_EVICTED = EventType.EVICTED
_LOAD_COMPLETED = EventType.LOAD_COMPLETED
_LOAD_FAILED = EventType.LOAD_FAILED
_STORE_FAILED = EventType.STORE_FAILED


def block_ids_of(spec: object) -> list[int]:
    """The CPU block ids of a manager's answer (the only kind of spec this manager returns)."""
    if isinstance(spec, BlockIDsLoadStoreSpec):
        return [int(b) for b in spec.block_ids]
    raise ConfigError(f"the manager returned {type(spec).__name__}, not a block-id spec")


class ManagerSteps(EngineBase):
    """Prepare/complete with the manager, count, publish, tell the tiers."""

    def _prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, *, publish: bool = True
    ) -> PrepareStoreOutput:
        """Prepare with the manager; ``publish=False`` leaves its events (evictions) for the
        caller to publish, which must happen before it yields to the loop."""
        if self._closed:
            self._check_open()
        if self._observers.watches_stores:
            self._observers.on_store(keys)
        if self._quarantine.pending:
            self._release_quarantined()
        out = self.manager.prepare_store(keys, ctx)
        if out is None:
            self._totals.stores_rejected += 1
            self._publish_manager_events()
            raise CapacityError(
                f"no room to store {len(keys)} keys: the CPU tier has too few free or "
                "evictable blocks (the rest are being read or written)"
            )
        self._totals.store_blocks_prepared += len(out.keys_to_store)
        self._totals.evicted_blocks += len(out.evicted_keys)
        if self._tiers is not None:
            self._tiers.on_prepared(out.keys_to_store, out.store_spec, out.evicted_keys)
        if publish:
            self._publish_manager_events()
        return out

    async def _tier_room(self, keys: Sequence[OffloadKey]) -> None:
        """With ``tier_write_backpressure``: wait (bounded) until the tiers' write queue has
        room for this store's write, before the store takes slots."""
        tiers = self._tiers
        if tiers is not None and tiers.needs_room(keys):
            await tiers.wait_for_room()

    def _evict_ahead(self, stored: int) -> None:
        """After a lone store's copy was launched: have the manager choose, in the copy's
        shadow, what the next store of ``stored`` blocks would evict (at most
        ``_evict_ahead_max``); they stay loadable until that store takes their slots.
        ``config.evict_ahead_fraction`` says why."""
        cast("EvictsAhead", self.manager).evict_ahead(min(stored, self._evict_ahead_max))

    def _finish_store(
        self, keys: list[OffloadKey], ctx: ReqContext, success: bool, reason: str = ""
    ) -> None:
        if not keys:
            return
        self.manager.complete_store(keys, ctx, success)
        if success:
            self._totals.store_blocks_completed += len(keys)
            self._publish_manager_events()
            if self._tiers is not None:
                self._tiers.on_stored(keys)
            return
        self._totals.store_blocks_failed += len(keys)
        self._publish_manager_events()
        if self._tiers is not None:
            self._tiers.on_store_failed(keys)
        self._hub.publish(_STORE_FAILED, keys, detail={"req_id": ctx.req_id, "reason": reason})

    def _prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[int]:
        self._check_open()
        return block_ids_of(self.manager.prepare_load(keys, ctx))

    def _finish_load(
        self, keys: list[OffloadKey], ctx: ReqContext, success: bool, detail: dict[str, Any]
    ) -> None:
        if not keys:
            return
        self.manager.complete_load(keys, ctx)
        if success:
            self._totals.load_blocks_completed += len(keys)
            self._hub.publish(_LOAD_COMPLETED, keys, detail={"req_id": ctx.req_id, **detail})
        else:
            self._totals.load_blocks_failed += len(keys)
            self._hub.publish(_LOAD_FAILED, keys, detail={"req_id": ctx.req_id, **detail})

    def _finish_load_job(
        self, keys: list[OffloadKey], ctx: ReqContext, success: bool, job_id: int
    ) -> None:
        """:meth:`_finish_load` of one of the engine's own load jobs (its detail names the
        job), without building the detail twice: one per load."""
        self.manager.complete_load(keys, ctx)
        if success:
            self._totals.load_blocks_completed += len(keys)
            kind = _LOAD_COMPLETED
        else:
            self._totals.load_blocks_failed += len(keys)
            kind = _LOAD_FAILED
        self._hub.publish(kind, keys, detail={"req_id": ctx.req_id, "job_id": job_id})

    def _publish_manager_events(self) -> None:
        publish = self._hub.publish
        for event in self.manager.take_events():
            publish(_EVICTED if event.removed else _STORED, event.keys, medium=event.medium)

    def _record_transfer(self, direction: str, result: TransferResult) -> None:
        if result.success:
            self._record_copy(direction, result.transfer_size, result.transfer_time)

    def _record_copy(self, direction: str, nbytes: int | None, seconds: float | None) -> None:
        """Count bytes moved into (store) or out of (load) the CPU tier, whoever copied them:
        our handlers, an HTTP block transfer, or a sidecar client reporting its own copy."""
        self._bytes[direction] += nbytes or 0
        if seconds is not None:
            self._seconds[direction] += seconds
            self._durations[direction].observe(seconds)

    def _rollback_lease(self, lease: Lease) -> None:
        """Undo an open lease with the manager: drop a store's keys, unpin a load's blocks."""
        if not lease.keys:
            return
        try:
            if lease.kind == "store":
                self.manager.complete_store(lease.keys, lease.req_context, success=False)
                if self._tiers is not None:
                    self._tiers.on_store_failed(lease.keys)
                self._totals.store_blocks_failed += len(lease.keys)
                self._publish_manager_events()
            else:
                self.manager.complete_load(lease.keys, lease.req_context)
        except OffloadError:
            logger.exception("rolling back %s lease %s failed", lease.kind, lease.lease_id)

    def _release_quarantined(self) -> None:
        """Free the quarantined slots whose grace period is over (cheap when none is due)."""
        for item in self._quarantine.due():
            try:
                if item.pinned_keys:
                    self.manager.complete_load(item.pinned_keys, item.req_context)
                elif self._fences is not None:
                    self._fences.release_fenced(item.block_ids)
            except OffloadError:
                logger.exception("releasing quarantined slots failed")
