"""The engine's core: the state every part shares, and the manager steps every operation takes.

:class:`~kvcache_offload.aio.engine.OffloadEngine` holds its parts (lookups, transfer jobs,
lease operations, block bytes, lifecycle); each holds this core. A store or load is the same
steps whoever moves the bytes (the engine's handlers, an HTTP block transfer, a sidecar client
under a lease): prepare with the manager, copy, complete with the manager, publish what
changed. The steps live here once; each also counts what it did (``aio/engine_stats.py``
reads the counters) and tells the tiers. The background runner (poller, lease reaper,
KV-event publisher, tier writer) starts here on the first operation that needs it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import anyio

from kvcache_offload.aio.engine_build import build_worker, open_kv_events
from kvcache_offload.aio.gc_freeze import HeapFreeze
from kvcache_offload.aio.leases import LeaseTable
from kvcache_offload.aio.observers import AccessObservers
from kvcache_offload.aio.poller import TransferPoller
from kvcache_offload.aio.slot_fence import BlockCopies, SlotQuarantine
from kvcache_offload.aio.types import EventType, Histogram
from kvcache_offload.config import OffloadConfig
from kvcache_offload.contracts.capabilities import EvictsAhead, FencesSlots, ReportsStats, ShutsDown
from kvcache_offload.contracts.load_store_spec import BlockIDsLoadStoreSpec
from kvcache_offload.contracts.manager import OffloadingManager
from kvcache_offload.control.spec_factory import OffloadingSpecFactory
from kvcache_offload.errors import CapacityError, ConfigError, OffloadError
from kvcache_offload.events.hub import EventHub

if TYPE_CHECKING:
    from kvcache_offload.aio.leases import Lease
    from kvcache_offload.aio.tiering import EngineTiers
    from kvcache_offload.contracts.handler import TransferResult
    from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
    from kvcache_offload.contracts.manager import PrepareStoreOutput, ReqContext
    from kvcache_offload.contracts.offload_key import OffloadKey
    from kvcache_offload.contracts.spec import OffloadingSpec
    from kvcache_offload.dataplane.handlers.router import OffloadingWorker
    from kvcache_offload.dataplane.memory.block_memory import BlockMemory
    from kvcache_offload.kv_events.publisher import KVEventPublisher

__all__ = ["LOAD_DIRECTION", "STORE_DIRECTION", "EngineCore", "EngineTotals", "block_ids_of"]

logger = logging.getLogger("kvcache_offload.aio.engine")

STORE_DIRECTION = "gpu_to_cpu"
LOAD_DIRECTION = "cpu_to_gpu"


class EngineTotals:
    """The engine's cumulative block and call counts, each named as the
    :class:`~kvcache_offload.aio.types.EngineStats` field it is reported as."""

    def __init__(self) -> None:
        self.lookups = self.lookup_keys = self.lookup_hit_blocks = 0
        self.store_blocks_prepared = self.store_blocks_completed = self.store_blocks_failed = 0
        self.stores_rejected = self.evicted_blocks = 0
        self.load_blocks_completed = self.load_blocks_failed = 0


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


def _ignore(lease: Lease) -> None:
    """No lease operations attached (yet): an expired lease needs nothing more."""


class EnginePart:
    """One of the parts an engine holds: its operations run over the one shared core."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core


class EngineCore:
    """The engine's shared state and manager steps (see the module docstring)."""

    def __init__(
        self,
        config: OffloadConfig | None,
        *,
        kv_caches: CanonicalKVCaches | None,
        spec: OffloadingSpec | None,
        access_observers: Sequence[object],
        poll_spin_s: float,
        poll_backoff_s: float,
        close_timeout_s: float,
        observer_budget: float | None,
    ) -> None:
        # Every argument is the engine's (``OffloadEngine``, which documents and defaults them).
        if config is None:
            config = spec.config if spec is not None else OffloadConfig()
        self.config = config
        self.spec = spec if spec is not None else OffloadingSpecFactory.create_spec(config)
        self.manager: OffloadingManager = self.spec.get_manager()
        self.close_timeout_s = close_timeout_s
        self._factor = self.spec.block_size_factor
        self._num_groups = len(self.spec.gpu_block_size)
        self._hub = EventHub(config.event_buffer_size, config.subscriber_queue_size)
        self._kv_events: KVEventPublisher | None = None
        if config.kv_events_endpoint:
            self._kv_events = open_kv_events(self, config)
        self.lease_expired: Callable[[Lease], None] = _ignore
        """What an expired lease calls (the engine's lease operations set it)."""
        self._leases = LeaseTable(self._expired, config.lease_ttl_s, config.max_open_leases)
        self._copies = BlockCopies()
        self._quarantine = SlotQuarantine(config.lease_grace_s)
        self._observers = AccessObservers(access_observers, budget=observer_budget)
        capacity = (
            int(self.manager.stats().num_blocks) if isinstance(self.manager, ReportsStats) else 0
        )
        # Shadow simulations (lab/shadow.py) size their samples from the tier's capacity.
        if isinstance(self.manager, ReportsStats):
            self._observers.bind_capacity(capacity)
        self._fences: FencesSlots | None = (
            self.manager if isinstance(self.manager, FencesSlots) else None
        )
        # Behind a lone store's copy, the policy chooses up to this many of the next store's
        # victims ahead (0: off; config.transfer.evict_ahead_fraction; only a policy whose choice
        # ahead is the one made at need, as LRU's).
        self._evict_ahead_max = (
            int(capacity * config.transfer.evict_ahead_fraction)
            if isinstance(self.manager, EvictsAhead) and self.manager.chooses_ahead
            else 0
        )
        self._worker: OffloadingWorker | None = None
        self._poller: TransferPoller | None = None
        if kv_caches is not None:
            self._worker = build_worker(self, kv_caches)
            self._poller = TransferPoller(
                self._worker,
                spin_s=poll_spin_s,
                backoff_s=poll_backoff_s,
                sleep_behind_s=config.transfer.completion_sleep_behind_s,
                caller_looks=config.transfer.completion_caller_looks,
            )
        self._block_memory: BlockMemory | None = None
        self._tiers: EngineTiers | None = None  # the engine builds them (engine_build.py)
        self._runner: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._closed = False
        self._heap_freeze = HeapFreeze()
        self._totals = EngineTotals()
        self._bytes = {STORE_DIRECTION: 0, LOAD_DIRECTION: 0}
        self._seconds = {STORE_DIRECTION: 0.0, LOAD_DIRECTION: 0.0}
        self._durations = {STORE_DIRECTION: Histogram(), LOAD_DIRECTION: Histogram()}

    def _expired(self, lease: Lease) -> None:
        self.lease_expired(lease)

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("the offload engine is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def _ensure_started(self) -> None:
        if self._runner is None and not self._closed:
            self._stop = asyncio.Event()
            self._runner = asyncio.get_running_loop().create_task(
                self._run_background(self._stop), name="kvcache-offload-engine"
            )

    async def _run_background(self, stop: asyncio.Event) -> None:
        try:
            async with anyio.create_task_group() as tg:
                if self._poller is not None:
                    tg.start_soon(self._poller.run, name="kvcache-offload-poller")
                tg.start_soon(self._leases.run, name="kvcache-offload-lease-reaper")
                if self._kv_events is not None:
                    tg.start_soon(self._kv_events.run, name="kvcache-offload-kv-events")
                if self._tiers is not None:
                    tg.start_soon(self._tiers.run, name="kvcache-offload-tier-writer")
                await stop.wait()
                tg.cancel_scope.cancel()
        except Exception:
            logger.exception("engine background task failed")
            raise

    @staticmethod
    def _guard(fn: Callable[[], object], what: str) -> None:
        try:
            fn()
        except Exception:
            logger.exception("%s failed", what)

    def _shutdown_spec(self, what: str) -> None:
        if isinstance(self.spec, ShutsDown):
            self._guard(self.spec.shutdown, what)

    async def _tier_room(self, keys: Sequence[OffloadKey]) -> None:
        """With ``tier_write_backpressure``: wait (bounded) until the tiers' write queue has
        room for this store's write, before the store takes slots."""
        tiers = self._tiers
        if tiers is not None and tiers.needs_room(keys):
            await tiers.wait_for_room()

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

    def _evict_ahead(self, stored: int) -> None:
        """After a lone store's copy was launched: have the manager choose, in the copy's
        shadow, what the next store of ``stored`` blocks would evict (at most
        ``_evict_ahead_max``); they stay loadable until that store takes their slots.
        ``config.transfer.evict_ahead_fraction`` says why."""
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
