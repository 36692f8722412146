"""The engine's event record: what happened to which keys, in one total order.

Every consumer of the engine's events (the in-process stream, the service's SSE feed and
metrics, the KV-event publisher for routers) reads these; the hub (:mod:`.hub`) numbers and
fans them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["EngineEvent", "EventType", "GapMarker"]


class EventType(StrEnum):
    STORED = "stored"
    EVICTED = "evicted"
    LOAD_COMPLETED = "load_completed"
    STORE_FAILED = "store_failed"
    LOAD_FAILED = "load_failed"
    LEASE_EXPIRED = "lease_expired"
    RESET = "reset"


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """One offloading event with its place in the engine's total order."""

    seq: int
    timestamp: float
    type: EventType
    keys: list[OffloadKey]
    medium: str = "CPU"
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GapMarker:
    """Delivered instead of events a subscriber missed: it fell behind or resumed too late."""

    missed: int
    """How many events were skipped."""
    next_seq: int
    """Sequence number of the next event the subscriber will receive."""
    restarted: bool = False
    """The resume point came from another run of the service (it restarted, so sequence
    numbers began again at 1): what happened after it is unknown; ``missed`` counts only
    this run's events that are no longer kept."""
