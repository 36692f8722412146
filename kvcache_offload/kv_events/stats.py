"""KVEventStats: the publisher's cumulative counters (exported as Prometheus counters)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KVEventStats"]


@dataclass(frozen=True)
class KVEventStats:
    """Cumulative counters of one publisher."""

    batches_published: int = 0
    events_published: int = 0
    """Wire events (BlockStored / BlockRemoved / AllBlocksCleared) in published batches."""
    replay_requests: int = 0
    batches_replayed: int = 0
    events_lost: int = 0
    """Engine events that fell out of the hub before the publisher could read them."""
