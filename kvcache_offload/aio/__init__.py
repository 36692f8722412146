"""The async core: :class:`OffloadEngine`, its event hub, leases and transfer poller."""

from kvcache_offload.aio.engine import OffloadEngine
from kvcache_offload.aio.leases import Lease, LeaseTable
from kvcache_offload.aio.poller import TransferPoller
from kvcache_offload.aio.types import (
    TRANSFER_DURATION_BUCKETS_S,
    EngineEvent,
    EngineStats,
    EventType,
    GapMarker,
    Histogram,
    KeyState,
    LoadLease,
    LoadResult,
    LookupResult,
    StoreLease,
    StoreResult,
)
from kvcache_offload.events.hub import EventCursor, EventHub, EventSubscription

__all__ = [
    "TRANSFER_DURATION_BUCKETS_S",
    "EngineEvent",
    "EngineStats",
    "EventCursor",
    "EventHub",
    "EventSubscription",
    "EventType",
    "GapMarker",
    "Histogram",
    "KeyState",
    "Lease",
    "LeaseTable",
    "LoadLease",
    "LoadResult",
    "LookupResult",
    "OffloadEngine",
    "StoreLease",
    "StoreResult",
    "TransferPoller",
]
