"""OffloadEngine: the asyncio facade over one spec's manager, worker, event hub and leases.

Every manager and policy call runs on the event-loop thread, so the control plane needs no
locks; only copies (worker threads or CUDA streams) and block-memory reads/writes run
elsewhere. The engine is one object assembled from one mixin per concept, each in its own
module (one class, so an operation costs no extra calls):

* ``aio/engine_lookups.py``: ``lookup``/``lookup_now``/``touch`` and their semantics;
* ``aio/engine_jobs.py``: the one-shot ``store``/``load`` jobs;
* ``aio/engine_leases.py``: the two-step operations of sidecar clients and lease expiry;
* ``aio/engine_block_bytes.py``: ``write_blocks``/``read_block`` for remote clients;
* ``aio/engine_lifecycle.py``: ``start``, the background runner, ``reset``, ``aclose``;
* ``aio/engine_steps.py``: the manager steps and counters those operations share;
* ``aio/engine_base.py``: the state they share.

This module builds the engine (spec, worker, poller, event hub, KV-event publisher, tiers) and
answers stats and event subscriptions. Pins never outlive an operation: open leases roll back
on expiry, :meth:`OffloadEngine.reset` and :meth:`OffloadEngine.aclose`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar

from kvcache_offload.aio.engine_base import (
    LOAD_DIRECTION,
    STORE_DIRECTION,
    EngineBase,
    EngineTotals,
)
from kvcache_offload.aio.engine_jobs import TransferJobs
from kvcache_offload.aio.engine_leases import LeaseOperations
from kvcache_offload.aio.engine_lookups import Lookups
from kvcache_offload.aio.engine_stats import collect_stats
from kvcache_offload.aio.event_hub import EventHub
from kvcache_offload.aio.gc_freeze import HeapFreeze
from kvcache_offload.aio.leases import LeaseTable
from kvcache_offload.aio.observers import AccessObservers
from kvcache_offload.aio.poller import TransferPoller
from kvcache_offload.aio.slot_fence import BlockCopies, SlotQuarantine
from kvcache_offload.aio.tiering import EngineTiers
from kvcache_offload.aio.types import EngineStats, EventType, Histogram
from kvcache_offload.config import OffloadConfig
from kvcache_offload.contracts.capabilities import (
    EvictsAhead,
    FencesSlots,
    ReportsStats,
    ShutsDown,
)
from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
from kvcache_offload.contracts.manager import OffloadingManager
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.contracts.spec import OffloadingSpec
from kvcache_offload.control.spec_factory import OffloadingSpecFactory
from kvcache_offload.dataplane.handlers.router import OffloadingWorker

if TYPE_CHECKING:
    from kvcache_offload.dataplane.memory.block_memory import BlockMemory
    from kvcache_offload.kv_events.publisher import KVEventPublisher

__all__ = ["OffloadEngine"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _hub_method(
    method: Callable[Concatenate[EventHub, _P], _R],
) -> Callable[Concatenate[EngineBase, _P], _R]:
    """An engine method that is the event hub's: one signature, kept by the hub."""

    def forward(engine: EngineBase, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return method(engine._hub, *args, **kwargs)

    forward.__name__, forward.__doc__ = method.__name__, method.__doc__
    forward.__wrapped__ = method  # type: ignore[attr-defined]  # inspect.signature shows the hub's
    return forward


class OffloadEngine(TransferJobs, LeaseOperations, Lookups):
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
        # victims ahead (0: off; config.evict_ahead_fraction; only a policy whose choice
        # ahead is the one made at need, as LRU's).
        self._evict_ahead_max = (
            int(capacity * config.evict_ahead_fraction)
            if isinstance(self.manager, EvictsAhead) and self.manager.chooses_ahead
            else 0
        )
        self._worker: OffloadingWorker | None = None
        self._poller: TransferPoller | None = None
        if kv_caches is not None:
            self._worker = self._build_worker(kv_caches)
            self._poller = TransferPoller(
                self._worker,
                spin_s=poll_spin_s,
                backoff_s=poll_backoff_s,
                sleep_behind_s=config.completion_sleep_behind_s,
                caller_looks=config.completion_caller_looks,
            )
        self._block_memory: BlockMemory | None = None
        self._tiers: EngineTiers | None = self._build_tiers()
        self._runner: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._closed = False
        self._heap_freeze = HeapFreeze()
        self._totals = EngineTotals()
        self._bytes = {STORE_DIRECTION: 0, LOAD_DIRECTION: 0}
        self._seconds = {STORE_DIRECTION: 0.0, LOAD_DIRECTION: 0.0}
        self._durations = {STORE_DIRECTION: Histogram(), LOAD_DIRECTION: Histogram()}

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
            block_nbytes=cfg.layout.bytes_per_block * self._factor,
        )
        engine_tiers = EngineTiers(
            tier_set, self.manager, self._get_block_memory, self.write_blocks, cfg.tier_write
        )
        if cfg.tier_write_backpressure:
            engine_tiers.backpressure_s = cfg.tier_write_backpressure_timeout_s
        return engine_tiers

    def _shutdown_spec(self, what: str) -> None:
        if isinstance(self.spec, ShutsDown):
            self._guard(self.spec.shutdown, what)

    def stats(self) -> EngineStats:
        self._release_quarantined()
        return collect_stats(self)

    subscribe = _hub_method(EventHub.subscribe)
    """An async iterator of events (and gap markers); ``since_seq`` resumes after it."""
    events = subscribe
    """Alias of :meth:`subscribe`."""

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
