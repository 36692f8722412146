"""The state every part of the engine shares, declared once.

:class:`~kvcache_offload.aio.engine.OffloadEngine` is assembled from one mixin per concept
(lookups, manager steps, transfer jobs, leases, block bytes, lifecycle); they share one object,
so an operation costs no more calls than it did in a single class. This base declares the
attributes the constructor (``aio/engine.py``) sets, so each mixin is type-checked on its own,
and holds the one check every operation starts with.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvcache_offload.errors import OffloadError

if TYPE_CHECKING:
    from kvcache_offload.aio.gc_freeze import HeapFreeze
    from kvcache_offload.aio.leases import LeaseTable
    from kvcache_offload.aio.observers import AccessObservers
    from kvcache_offload.aio.poller import TransferPoller
    from kvcache_offload.aio.slot_fence import BlockCopies, SlotQuarantine
    from kvcache_offload.aio.tiering import EngineTiers
    from kvcache_offload.aio.types import Histogram
    from kvcache_offload.config import OffloadConfig
    from kvcache_offload.contracts.capabilities import FencesSlots
    from kvcache_offload.contracts.manager import OffloadingManager
    from kvcache_offload.contracts.spec import OffloadingSpec
    from kvcache_offload.dataplane.handlers.router import OffloadingWorker
    from kvcache_offload.dataplane.memory.block_memory import BlockMemory
    from kvcache_offload.events.hub import EventHub
    from kvcache_offload.kv_events.publisher import KVEventPublisher

__all__ = ["LOAD_DIRECTION", "STORE_DIRECTION", "EngineBase", "EngineTotals"]

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


class EngineBase:
    """The engine's shared state (set by ``OffloadEngine.__init__``) and its open check."""

    config: OffloadConfig
    spec: OffloadingSpec
    manager: OffloadingManager
    close_timeout_s: float
    _factor: int
    _num_groups: int
    _hub: EventHub
    _kv_events: KVEventPublisher | None
    _leases: LeaseTable
    _copies: BlockCopies
    _quarantine: SlotQuarantine
    _observers: AccessObservers
    _fences: FencesSlots | None
    _evict_ahead_max: int
    _worker: OffloadingWorker | None
    _poller: TransferPoller | None
    _block_memory: BlockMemory | None
    _tiers: EngineTiers | None
    _runner: asyncio.Task[None] | None
    _stop: asyncio.Event | None
    _closed: bool
    _heap_freeze: HeapFreeze
    _totals: EngineTotals
    _bytes: dict[str, int]
    _seconds: dict[str, float]
    _durations: dict[str, Histogram]

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("the offload engine is closed")

    @property
    def closed(self) -> bool:
        return self._closed
