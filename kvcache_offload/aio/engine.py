"""OffloadEngine: the asyncio facade over one spec's manager, worker, event hub and leases.

Every manager and policy call runs on the event-loop thread, so the control plane needs no
locks; only copies (worker threads or CUDA streams) and block-memory reads/writes run
elsewhere. One background runner task owns an anyio task group with the transfer poller and
the lease reaper; it starts on ``async with`` (or on the first operation that needs it) and
ends in :meth:`OffloadEngine.aclose`.

Lookup semantics (vLLM's maximal prefix lookup, with "retry later" kept apart):

* ``states[i]`` is each key's state: READY (loadable), WRITING (a store is in flight) or ABSENT.
* ``hits`` is the number of leading READY keys: what can be loaded now.
* ``pending`` is True when a WRITING key comes before the first ABSENT key: waiting for the
  store to finish would give a longer hit, so a scheduler should defer rather than load
  ``hits`` keys now (vLLM's ``None``).

Pins never outlive an operation: a transfer's completion callback (run by the poller, not by
the awaiting coroutine) completes the store or load even if the caller was cancelled; a
refused or failed transfer completes the store with ``success=False``; open leases roll back
on expiry, :meth:`reset` and :meth:`aclose`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from kvcache_offload._closing import AsyncClosing
from kvcache_offload.aio.engine_stats import collect_stats
from kvcache_offload.aio.event_hub import EventHub, EventSubscription
from kvcache_offload.aio.gpu_specs import gpu_spec_for_keys
from kvcache_offload.aio.leases import Lease, LeaseTable
from kvcache_offload.aio.observers import AccessObservers
from kvcache_offload.aio.poller import TransferPoller
from kvcache_offload.aio.slot_fence import BlockCopies, SlotQuarantine
from kvcache_offload.aio.tiering import CPU_TIER, EngineTiers
from kvcache_offload.aio.types import (
    EngineStats,
    EventType,
    Histogram,
    KeyState,
    LoadLease,
    LoadResult,
    LookupResult,
    StoreLease,
    StoreResult,
)
from kvcache_offload.config import OffloadConfig
from kvcache_offload.contracts.capabilities import (
    FencesSlots,
    HasBlockMemory,
    ReportsStats,
    ShutsDown,
)
from kvcache_offload.contracts.handler import TransferResult
from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
from kvcache_offload.contracts.load_store_spec import (
    BlockIDsLoadStoreSpec,
    GPULoadStoreSpec,
)
from kvcache_offload.contracts.manager import (
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.contracts.spec import OffloadingSpec
from kvcache_offload.control.spec_factory import OffloadingSpecFactory
from kvcache_offload.dataplane.handlers.router import OffloadingWorker
from kvcache_offload.errors import (
    CapacityError,
    ConfigError,
    OffloadError,
    TransferError,
)

if TYPE_CHECKING:
    from kvcache_offload.dataplane.memory.block_memory import BlockMemory
    from kvcache_offload.kv_events.publisher import KVEventPublisher

__all__ = ["OffloadEngine"]

logger = logging.getLogger(__name__)

STORE_DIRECTION = "gpu_to_cpu"
LOAD_DIRECTION = "cpu_to_gpu"
GpuBlocks = Sequence[int] | np.ndarray | GPULoadStoreSpec

_READY, _WRITING, _ABSENT = KeyState.READY, KeyState.WRITING, KeyState.ABSENT
_STATE_OF: dict[bool | None, KeyState] = {True: _READY, None: _WRITING, False: _ABSENT}
_NO_CONTEXT = ReqContext()
"""Shared by calls that pass no context (managers only read it)."""


def _block_ids(spec: object) -> list[int]:
    if isinstance(spec, BlockIDsLoadStoreSpec):
        return [int(b) for b in spec.block_ids]
    raise ConfigError(f"the manager returned {type(spec).__name__}, not a block-id spec")


class OffloadEngine(AsyncClosing):
    """Async offloading engine; see the module docstring for the semantics.

    ``access_observers`` receive the access stream (``on_lookup(keys, hits)``,
    ``on_store(keys)``) and may provide ``mrc_stats(capacity_blocks)`` for :meth:`stats`;
    an observer that raises is logged and otherwise ignored.
    """

    def __init__(
        self,
        config: OffloadConfig | None = None,
        *,
        kv_caches: CanonicalKVCaches | None = None,
        spec: OffloadingSpec | None = None,
        access_observers: Sequence[object] = (),
        poll_spin_s: float = 0.02,
        poll_backoff_s: float = 0.001,
        close_timeout_s: float = 30.0,
        observer_budget: float | None = None,
    ) -> None:
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
            self._kv_events = self._open_kv_events(config)
        self._leases = LeaseTable(
            self._on_lease_expired, config.lease_ttl_s, config.max_open_leases
        )
        self._copies = BlockCopies()
        self._quarantine = SlotQuarantine(config.lease_grace_s)
        self._observers = AccessObservers(access_observers, budget=observer_budget)
        # Shadow simulations (lab/shadow.py) size their samples from the tier's capacity.
        if isinstance(self.manager, ReportsStats):
            self._observers.bind_capacity(int(self.manager.stats().num_blocks))
        self._fences: FencesSlots | None = (
            self.manager if isinstance(self.manager, FencesSlots) else None
        )
        self._worker: OffloadingWorker | None = None
        self._poller: TransferPoller | None = None
        if kv_caches is not None:
            self._worker = self._build_worker(kv_caches)
            self._poller = TransferPoller(
                self._worker, spin_s=poll_spin_s, backoff_s=poll_backoff_s
            )
        self._block_memory: BlockMemory | None = None
        self._tiers: EngineTiers | None = self._build_tiers()
        self._runner: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._closed = False
        # cumulative counters
        self._lookups = 0
        self._lookup_keys = 0
        self._lookup_hit_blocks = 0
        self._store_prepared = 0
        self._store_completed = 0
        self._store_failed = 0
        self._stores_rejected = 0
        self._load_completed = 0
        self._load_failed = 0
        self._evicted = 0
        self._bytes = {STORE_DIRECTION: 0, LOAD_DIRECTION: 0}
        self._seconds = {STORE_DIRECTION: 0.0, LOAD_DIRECTION: 0.0}
        self._durations = {STORE_DIRECTION: Histogram(), LOAD_DIRECTION: Histogram()}

    # -- construction helpers ----------------------------------------------------------------

    def _build_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        worker = OffloadingWorker()
        try:
            for src_cls, dst_cls, handler in self.spec.get_handlers(kv_caches):
                worker.register_handler(src_cls, dst_cls, handler)
        except BaseException:
            worker.shutdown()
            self._shutdown_spec("shutting the spec down after a failed start")
            raise
        return worker

    def _open_kv_events(self, config: OffloadConfig) -> KVEventPublisher:
        """The ZMQ publisher of block events for routers (docs/kv-events.md)."""
        from kvcache_offload.kv_events.publisher import KVEventPublisher

        factor = self.spec.block_size_factor
        try:
            return KVEventPublisher(
                self._hub,
                str(config.kv_events_endpoint),
                replay_endpoint=config.kv_events_replay_endpoint,
                topic=config.kv_events_topic,
                encoding=config.kv_events_encoding,
                hash_format=config.kv_events_hash_format,
                block_sizes=[size * factor for size in self.spec.gpu_block_size],
                media=config.kv_events_media,
                replay_batches=max(config.kv_events_replay_batches or 0, config.event_buffer_size),
                hwm=config.kv_events_hwm,
                data_parallel_rank=config.kv_events_data_parallel_rank,
            )
        except BaseException:
            self._shutdown_spec("shutting the spec down after a failed start")
            raise

    def _build_tiers(self) -> EngineTiers | None:
        """Secondary tiers from the config (disk, Redis), or None: then no hook costs anything."""
        cfg = self.config
        if cfg.disk_path is None and not cfg.remote_url:
            return None
        from kvcache_offload.tiers import TierSet, layout_fingerprint, tiers_from_config

        fingerprint = layout_fingerprint(
            model_id=cfg.model_id,
            kv_dtype=cfg.kv_dtype,
            block_nbytes=cfg.layout.bytes_per_block * self._factor,
            block_tokens=self.spec.gpu_block_size[0] * self._factor,
            gpu_block_sizes=cfg.layout.gpu_block_sizes,
            world_size=cfg.layout.world_size,
        )
        tiers = tiers_from_config(cfg, fingerprint)
        if not tiers:
            return None

        def publish(kind: str, keys: list[OffloadKey], medium: str) -> None:
            self._hub.publish(EventType(kind), keys, medium=medium)

        tier_set = TierSet(
            tiers,
            queue_size=cfg.tier_queue_size,
            read_timeout_s=cfg.tier_read_timeout_s,
            on_event=publish,
        )
        return EngineTiers(
            tier_set, self.manager, self._get_block_memory, self.write_blocks, cfg.tier_write
        )

    def _shutdown_spec(self, what: str) -> None:
        if isinstance(self.spec, ShutsDown):
            self._guard(self.spec.shutdown, what)

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> OffloadEngine:
        await self.start()
        return self

    async def start(self) -> None:
        """Start the background tasks and, for a shared region, set the region up off-loop."""
        self._check_open()
        self._ensure_started()
        if self.config.shared_region and self._block_memory is None:
            await self._get_block_memory()
        if self._tiers is not None:
            await self._tiers.open()

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

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("the offload engine is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        """Finish or fail in-flight jobs, roll back leases, stop tasks, release everything.

        Idempotent and shielded from cancellation, so it also cleans up after errors.
        """
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            poller = self._poller
            if poller is not None and poller.in_flight:
                drained = False
                if self._runner is not None and not self._runner.done():
                    drained = await poller.drain(self.close_timeout_s)
                if not drained:
                    n = poller.fail_all("the engine closed before the transfer finished")
                    logger.warning("closed with %d transfers still in flight", n)
            for lease in self._leases.take_all():
                self._rollback_lease(lease)
            if self._tiers is not None:  # queued tier writes finish while the writer runs
                await self._tiers.aclose(self.close_timeout_s if self._runner else 0.0)
            if self._runner is not None and self._stop is not None:
                self._stop.set()
                try:
                    await self._runner
                except BaseException:
                    logger.debug("background task ended with an error", exc_info=True)
            self._hub.close()
            if self._kv_events is not None:
                try:
                    await self._kv_events.aclose()
                except Exception:
                    logger.exception("closing the KV-event publisher failed")
            if self._worker is not None:
                try:
                    await anyio.to_thread.run_sync(self._worker.shutdown)
                except Exception:
                    logger.exception("shutting the worker down failed")
            if self._block_memory is not None:
                self._guard(self._block_memory.close, "closing block memory")
            self._guard(self.manager.shutdown, "shutting the manager down")
            if isinstance(self.spec, ShutsDown):  # handlers, memory, region (file work)
                try:
                    await anyio.to_thread.run_sync(self.spec.shutdown)
                except Exception:
                    logger.exception("shutting the spec down failed")

    @staticmethod
    def _guard(fn: Callable[[], object], what: str) -> None:
        try:
            fn()
        except Exception:
            logger.exception("%s failed", what)

    # -- lookups -----------------------------------------------------------------------------

    async def lookup(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext | None = None,
        *,
        prefix_only: bool = False,
    ) -> LookupResult:
        """Per-key states plus the ready prefix and vLLM's "retry later" flag.

        With ``prefix_only`` the walk stops at the first absent key (as vLLM's does), so
        ``states`` covers only the keys up to and including it. With secondary tiers, keys the
        CPU tier lacks are looked up below (one batch per tier) and ``tiers`` names each key's.
        """
        result = self.lookup_now(keys, req_context, prefix_only=prefix_only)
        if self._tiers is None or result.tiers is not None:
            return result
        return await self._tiers.extend_lookup(keys, result, prefix_only=prefix_only)

    def lookup_now(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext | None = None,
        *,
        prefix_only: bool = False,
    ) -> LookupResult:
        """:meth:`lookup` without the coroutine, for callers already on the loop thread."""
        ctx = req_context if req_context is not None else _NO_CONTEXT
        lookup = self.manager.lookup
        if prefix_only:
            states: list[KeyState] = []
            append = states.append
            hits = -1
            pending = False
            for key in keys:
                found = lookup(key, ctx)
                if found:
                    append(_READY)
                    continue
                if hits < 0:
                    hits = len(states)
                if found is None:
                    append(_WRITING)
                    pending = True
                else:
                    append(_ABSENT)
                    break
            if hits < 0:
                hits = len(states)
        else:
            # Comprehensions and list.index run at C speed: this is the hot path of /v1/lookup.
            answers = [lookup(key, ctx) for key in keys]
            states = [_STATE_OF[found] for found in answers]
            n = len(answers)
            first_absent = answers.index(False) if False in answers else n
            first_writing = answers.index(None) if None in answers else n
            hits = min(first_absent, first_writing)
            pending = first_writing < first_absent
        self._lookups += 1
        self._lookup_keys += len(keys)
        self._lookup_hit_blocks += hits
        if self._observers.watches_lookups:
            self._observers.on_lookup(keys, hits)
        # With tiers, an all-CPU answer names its tier here (the cheap, common case).
        tiers: list[str | None] | None = None
        if self._tiers is not None and hits == len(states):
            tiers = [CPU_TIER] * hits
        return LookupResult(hits=hits, pending=pending, states=states, tiers=tiers)

    async def touch(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None
    ) -> None:
        """Mark keys recently used; the first key ends up most recently used."""
        self.manager.touch(keys, req_context if req_context is not None else _NO_CONTEXT)

    # -- manager steps shared by the one-shot and two-step operations ----------------------

    def _prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput:
        self._check_open()
        if self._observers.watches_stores:
            self._observers.on_store(keys)
        self._release_quarantined()
        out = self.manager.prepare_store(keys, ctx)
        if out is None:
            self._stores_rejected += 1
            self._publish_manager_events()
            raise CapacityError(
                f"no room to store {len(keys)} keys: the CPU tier has too few free or "
                "evictable blocks (the rest are being read or written)"
            )
        self._store_prepared += len(out.keys_to_store)
        self._evicted += len(out.evicted_keys)
        if self._tiers is not None:
            self._tiers.on_prepared(out.keys_to_store, out.store_spec, out.evicted_keys)
        self._publish_manager_events()
        return out

    def _finish_store(
        self, keys: list[OffloadKey], ctx: ReqContext, success: bool, reason: str = ""
    ) -> None:
        if not keys:
            return
        self.manager.complete_store(keys, ctx, success)
        if success:
            self._store_completed += len(keys)
            self._publish_manager_events()
            if self._tiers is not None:
                self._tiers.on_stored(keys)
            return
        self._store_failed += len(keys)
        self._publish_manager_events()
        if self._tiers is not None:
            self._tiers.on_store_failed(keys)
        self._hub.publish(
            EventType.STORE_FAILED, keys, detail={"req_id": ctx.req_id, "reason": reason}
        )

    def _prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[int]:
        self._check_open()
        return _block_ids(self.manager.prepare_load(keys, ctx))

    def _finish_load(
        self, keys: list[OffloadKey], ctx: ReqContext, success: bool, detail: dict[str, Any]
    ) -> None:
        if not keys:
            return
        self.manager.complete_load(keys, ctx)
        if success:
            self._load_completed += len(keys)
            self._hub.publish(
                EventType.LOAD_COMPLETED, keys, detail={"req_id": ctx.req_id, **detail}
            )
        else:
            self._load_failed += len(keys)
            self._hub.publish(EventType.LOAD_FAILED, keys, detail={"req_id": ctx.req_id, **detail})

    def _publish_manager_events(self) -> None:
        for event in self.manager.take_events():
            kind = EventType.EVICTED if event.removed else EventType.STORED
            self._hub.publish(kind, event.keys, medium=event.medium)

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

    # -- one-shot transfers ------------------------------------------------------------------

    def _require_poller(self) -> TransferPoller:
        if self._poller is None:
            raise ConfigError(
                "no KV caches registered: pass kv_caches= to OffloadEngine to store or load "
                "GPU blocks (sidecar clients use prepare_store/prepare_load instead)"
            )
        return self._poller

    async def store(
        self,
        keys: Sequence[OffloadKey],
        gpu_blocks: GpuBlocks,
        req_context: ReqContext | None = None,
    ) -> StoreResult:
        """Offload ``keys`` from ``gpu_blocks`` (``block_size_factor`` ids per key).

        Keys already offloaded are skipped. Raises :class:`CapacityError` when there is no
        room and :class:`TransferError` when the copy failed (the store is then rolled back).
        """
        poller = self._require_poller()
        ctx = req_context if req_context is not None else ReqContext()
        keys = list(keys)
        out = self._prepare_store(keys, ctx)
        stored = out.keys_to_store
        if not stored:
            return StoreResult([], out.evicted_keys)
        try:
            gpu_spec = gpu_spec_for_keys(
                keys,
                gpu_blocks,
                factor=self._factor,
                num_groups=self._num_groups,
                selected=self._positions(keys, stored),
            )
        except BaseException:
            self._finish_store(stored, ctx, False, "invalid GPU block ids")
            raise

        def on_done(result: TransferResult) -> None:
            self._record_transfer(STORE_DIRECTION, result)
            self._finish_store(stored, ctx, result.success, "transfer failed")

        self._ensure_started()
        try:
            future = poller.submit((gpu_spec, out.store_spec), on_done)
        except BaseException:
            self._finish_store(stored, ctx, False, "transfer refused")
            raise
        result = await future
        if not result.success:
            raise TransferError(f"storing {len(stored)} blocks failed (job {result.job_id})")
        return StoreResult(
            stored, out.evicted_keys, result.transfer_size or 0, result.transfer_time or 0.0
        )

    @staticmethod
    def _positions(keys: list[OffloadKey], subset: list[OffloadKey]) -> list[int]:
        """Index in ``keys`` of each key of ``subset`` (first occurrence)."""
        if len(subset) == len(keys) and subset == keys:
            return list(range(len(keys)))
        first: dict[OffloadKey, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        return [first[k] for k in subset]

    async def load(
        self,
        keys: Sequence[OffloadKey],
        gpu_blocks: GpuBlocks,
        req_context: ReqContext | None = None,
    ) -> LoadResult:
        """Copy ready ``keys`` back into ``gpu_blocks``.

        Raises :class:`BlockStateError` if a key is not ready (nothing is pinned then) and
        :class:`TransferError` if the copy failed (the blocks are unpinned).
        """
        poller = self._require_poller()
        ctx = req_context if req_context is not None else ReqContext()
        keys = list(keys)
        if not keys:
            return LoadResult([])
        if self._tiers is not None:
            await self._tiers.promote(keys)
        gpu_spec = gpu_spec_for_keys(
            keys, gpu_blocks, factor=self._factor, num_groups=self._num_groups
        )
        self._check_open()
        cpu_spec = self.manager.prepare_load(keys, ctx)

        def on_done(result: TransferResult) -> None:
            self._record_transfer(LOAD_DIRECTION, result)
            self._finish_load(keys, ctx, result.success, {"job_id": result.job_id})

        self._ensure_started()
        try:
            future = poller.submit((cpu_spec, gpu_spec), on_done)
        except BaseException:
            self._finish_load(keys, ctx, False, {"reason": "transfer refused"})
            raise
        result = await future
        if not result.success:
            raise TransferError(f"loading {len(keys)} blocks failed (job {result.job_id})")
        return LoadResult(keys, result.transfer_size or 0, result.transfer_time or 0.0)

    # -- two-step operations (sidecar clients move the bytes) -------------------------------

    async def prepare_store(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext | None = None,
        ttl_s: float | None = None,
    ) -> StoreLease:
        """Allocate CPU slots for the keys not yet offloaded; complete within the TTL."""
        if ttl_s is not None:
            LeaseTable.check_ttl(ttl_s)
        ctx = req_context if req_context is not None else ReqContext()
        out = self._prepare_store(list(keys), ctx)
        lease = self._leases.add(
            "store",
            list(out.keys_to_store),
            _block_ids(out.store_spec),
            ctx,
            ttl_s,
            list(out.evicted_keys),
        )
        self._ensure_started()
        return StoreLease(
            lease_id=lease.lease_id,
            keys_to_store=lease.keys,
            block_ids=lease.block_ids,
            evicted_keys=lease.evicted_keys,
            expires_at=lease.expires_at,
        )

    async def complete_store(
        self,
        lease_id: str,
        success: bool = True,
        transfer_bytes: int | None = None,
        transfer_seconds: float | None = None,
    ) -> list[OffloadKey]:
        """Make the lease's blocks loadable (or drop them); returns the keys now stored.

        A sidecar client may report the size and duration of its own copy so that transfer
        metrics cover bytes that never went through this process.
        """
        self._check_open()
        lease = self._leases.pop(lease_id, "store")
        self._finish_store(lease.keys, lease.req_context, success, "client reported failure")
        if success:
            self._record_copy(STORE_DIRECTION, transfer_bytes, transfer_seconds)
        return list(lease.keys) if success else []

    async def prepare_load(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext | None = None,
        ttl_s: float | None = None,
    ) -> LoadLease:
        """Pin ready blocks for reading; :class:`BlockStateError` if one is not ready."""
        if ttl_s is not None:
            LeaseTable.check_ttl(ttl_s)
        ctx = req_context if req_context is not None else ReqContext()
        keys = list(keys)
        if self._tiers is not None:
            await self._tiers.promote(keys)
        block_ids = self._prepare_load(keys, ctx)
        lease = self._leases.add("load", keys, block_ids, ctx, ttl_s)
        self._ensure_started()
        return LoadLease(lease.lease_id, lease.keys, lease.block_ids, lease.expires_at)

    async def complete_load(
        self,
        lease_id: str,
        transfer_bytes: int | None = None,
        transfer_seconds: float | None = None,
    ) -> None:
        """Unpin the lease's blocks; the client may report its copy as in complete_store."""
        self._check_open()
        lease = self._leases.pop(lease_id, "load")
        self._finish_load(lease.keys, lease.req_context, True, {"lease_id": lease_id})
        self._record_copy(LOAD_DIRECTION, transfer_bytes, transfer_seconds)

    def _on_lease_expired(self, lease: Lease) -> None:
        self._quarantine_lease(lease)
        self._hub.publish(
            EventType.LEASE_EXPIRED,
            lease.keys,
            detail={
                "lease_id": lease.lease_id,
                "kind": lease.kind,
                "req_id": lease.req_context.req_id,
            },
        )

    def _quarantine_lease(self, lease: Lease) -> None:
        """Roll an expired lease back without letting its slots change owner yet.

        The sidecar client may still be copying (see :mod:`kvcache_offload.aio.slot_fence`):
        a store lease's keys are dropped but its slots fenced, a load lease's blocks stay
        pinned, both until the grace period is over.
        """
        fences = self._fences
        if not lease.keys or fences is None or self._quarantine.grace_s <= 0:
            self._rollback_lease(lease)
            return
        try:
            if lease.kind == "store":
                self._quarantine.fence(fences.fence(lease.keys))
                self._store_failed += len(lease.keys)
                self._publish_manager_events()
            else:
                self._quarantine.pin(list(lease.keys), lease.req_context)
        except OffloadError:
            logger.exception("quarantining %s lease %s failed", lease.kind, lease.lease_id)

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

    def _rollback_lease(self, lease: Lease) -> None:
        if not lease.keys:
            return
        try:
            if lease.kind == "store":
                self.manager.complete_store(lease.keys, lease.req_context, success=False)
                if self._tiers is not None:
                    self._tiers.on_store_failed(lease.keys)
                self._store_failed += len(lease.keys)
                self._publish_manager_events()
            else:
                self.manager.complete_load(lease.keys, lease.req_context)
        except OffloadError:
            logger.exception("rolling back %s lease %s failed", lease.kind, lease.lease_id)

    # -- block bytes (remote clients) --------------------------------------------------------

    def _memory(self) -> BlockMemory:
        if self._block_memory is None:
            if not isinstance(self.spec, HasBlockMemory):
                raise ConfigError(f"{type(self.spec).__name__} has no block memory")
            self._block_memory = self.spec.get_block_memory()
        return self._block_memory

    async def _get_block_memory(self) -> BlockMemory:
        """The spec's block memory (the spec creates it once, also for callers at once)."""
        if self._block_memory is None:
            self._block_memory = await anyio.to_thread.run_sync(self._memory)
        return self._block_memory

    @property
    def block_nbytes(self) -> int:
        """Bytes of one offloaded block: the page size of ``write_blocks``/``read_block``."""
        return self._memory().block_nbytes

    def region_info(self) -> dict[str, Any] | None:
        """The shared region's description when the blocks live in one, else None."""
        if not self.config.shared_region:
            return None
        return self._memory().describe()

    async def write_blocks(
        self, keys: Sequence[OffloadKey], data: Sequence[bytes | bytearray | memoryview]
    ) -> StoreResult:
        """Store blocks whose bytes the caller brings (remote mode); ``data[i]`` is ``keys[i]``."""
        keys = list(keys)
        if len(data) != len(keys):
            raise ConfigError(f"got {len(data)} data blocks for {len(keys)} keys")
        memory = await self._get_block_memory()
        size = memory.block_nbytes
        for key, blob in zip(keys, data, strict=True):
            if len(memoryview(blob).cast("B")) != size:
                raise ConfigError(
                    f"block data for key {key.hex()} must be {size} bytes, got {len(blob)}"
                )
        ctx = ReqContext()
        out = self._prepare_store(keys, ctx)
        stored = out.keys_to_store
        if not stored:
            return StoreResult([], out.evicted_keys)
        by_key: dict[OffloadKey, bytes | bytearray | memoryview] = {}
        for key, blob in zip(keys, data, strict=True):
            by_key.setdefault(key, blob)
        writes = list(zip(_block_ids(out.store_spec), (by_key[k] for k in stored), strict=True))

        def copy_in() -> float:
            start = time.perf_counter()
            for block_id, blob in writes:
                memory.write(block_id, blob)
            return time.perf_counter() - start

        success = False
        # Counted from before the first await: a reset waits for this copy (slot_fence).
        with self._copies.copying():
            try:
                seconds = await anyio.to_thread.run_sync(copy_in)
                success = True
            except OffloadError as exc:
                raise TransferError(f"writing {len(stored)} blocks failed: {exc}") from exc
            finally:
                self._finish_store(stored, ctx, success, "" if success else "block write failed")
        self._record_copy(STORE_DIRECTION, size * len(stored), seconds)
        return StoreResult(stored, out.evicted_keys, size * len(stored), seconds)

    async def read_block(self, key: OffloadKey) -> bytes:
        """The bytes of one ready block; :class:`BlockStateError` if it is not ready."""
        memory = await self._get_block_memory()
        ctx = ReqContext()
        if self._tiers is not None:
            await self._tiers.promote([key])
        (block_id,) = self._prepare_load([key], ctx)
        start = time.perf_counter()
        with self._copies.copying():
            try:
                data = await anyio.to_thread.run_sync(memory.read, block_id)
            finally:
                self.manager.complete_load([key], ctx)
        self._record_copy(LOAD_DIRECTION, len(data), time.perf_counter() - start)
        self._load_completed += 1
        self._hub.publish(EventType.LOAD_COMPLETED, [key], detail={"req_id": "", "remote": True})
        return data

    # -- reset, stats, events ----------------------------------------------------------------

    async def reset(self) -> None:
        """Drop every offloaded block once in-flight jobs and block copies finished.

        Open leases roll back; their slots (which sidecar clients may still be copying) stay
        fenced for the grace period, so a late copy never lands in a block of another key.
        """
        self._check_open()
        poller = self._poller
        copies = self._copies
        while (poller is not None and poller.in_flight) or copies.running:
            if poller is not None and poller.in_flight:
                self._ensure_started()
                if not await poller.drain(self.close_timeout_s):
                    raise TransferError("reset gave up waiting for in-flight transfers")
            if not await copies.wait_idle(self.close_timeout_s):
                raise TransferError("reset gave up waiting for in-flight block copies")
        # From here on everything is synchronous: no job, copy or lease can sneak in.
        fences = self._fences
        leases = self._leases.take_all()
        if fences is not None and self._quarantine.grace_s > 0:
            fenced: list[int] = []
            for lease in leases:
                fenced += fences.fence(lease.keys)
                if lease.kind == "store":
                    self._store_failed += len(lease.keys)
            for item in self._quarantine.take_pinned():
                fenced += fences.fence(item.pinned_keys)
            self._quarantine.fence(fenced)
        else:
            for lease in leases:
                self._rollback_lease(lease)
        self._publish_manager_events()
        self.manager.reset_cache()
        if self._tiers is not None:
            self._tiers.on_reset()
        self._hub.publish(EventType.RESET, [])

    def stats(self) -> EngineStats:
        self._release_quarantined()
        return collect_stats(self)

    def subscribe(
        self,
        types: Collection[EventType | str] | None = None,
        since_seq: int | None = None,
        queue_size: int | None = None,
    ) -> EventSubscription:
        """An async iterator of events (and gap markers); ``since_seq`` resumes after it."""
        return self._hub.subscribe(types, since_seq=since_seq, queue_size=queue_size)

    def events(
        self,
        types: Collection[EventType | str] | None = None,
        since_seq: int | None = None,
        queue_size: int | None = None,
    ) -> EventSubscription:
        """Alias of :meth:`subscribe`."""
        return self.subscribe(types, since_seq=since_seq, queue_size=queue_size)

    @property
    def event_hub(self) -> EventHub:
        return self._hub

    @property
    def kv_events(self) -> KVEventPublisher | None:
        """The ZMQ KV-event publisher, when ``kv_events_endpoint`` is configured."""
        return self._kv_events

    @property
    def worker(self) -> OffloadingWorker | None:
        return self._worker
