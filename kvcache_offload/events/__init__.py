"""The engine's events: the record, its total order and fan-out to subscribers (the hub).

Below the async core and the KV-event publisher, which both build on it.
"""

from kvcache_offload.events.hub import EventCursor, EventHub, EventSubscription
from kvcache_offload.events.records import EngineEvent, EventType, GapMarker

__all__ = [
    "EngineEvent",
    "EventCursor",
    "EventHub",
    "EventSubscription",
    "EventType",
    "GapMarker",
]
