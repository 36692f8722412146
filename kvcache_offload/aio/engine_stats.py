"""The engine's statistics snapshot: counters, the manager's tier, observers and tiers.

Assembled here, not in the engine, so that the facade keeps to its operations; the engine's
counters are read, never written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcache_offload.aio.types import EngineStats, Histogram
from kvcache_offload.contracts.capabilities import (
    CountsFencedSlots,
    ReportsStats,
    SizesOffloadedBlocks,
    SkipsStores,
)

if TYPE_CHECKING:
    from kvcache_offload.aio.engine_core import EngineCore

__all__ = ["collect_stats", "tier_counts"]


def tier_counts(snap: Any, policy: str) -> dict[str, Any]:
    """The ``EngineStats`` fields a manager's own ``stats()`` snapshot gives (None: a manager
    without one reports its configured ``policy`` and zeros); shared by the engine and the
    vLLM plug-in's read-only view, so both export the same block counts."""
    if snap is None:
        return {"policy": policy}
    return {
        "policy": str(snap.policy),
        "capacity_blocks": int(snap.num_blocks),
        "blocks_free": int(snap.free),
        "blocks_writing": int(snap.writing),
        "blocks_idle": int(snap.idle),
        "blocks_reading": int(snap.reading),
        # managers without fences report none
        "blocks_fenced": int(snap.fenced) if isinstance(snap, CountsFencedSlots) else 0,
        # the manager counts its hints' effects (a manager without hints reports none)
        "discarded_blocks": int(getattr(snap, "discarded_blocks", 0)),
        "released_evictions": int(getattr(snap, "released_evictions", 0)),
        "evicted_ahead_blocks": int(getattr(snap, "ahead_evictions", 0)),
        "blocks_released": int(getattr(snap, "released", 0)),
    }


def collect_stats(engine: EngineCore) -> EngineStats:
    """One consistent snapshot (the engine runs on one loop thread: nothing moves meanwhile)."""
    e = engine
    manager = e.manager
    snap = manager.stats() if isinstance(manager, ReportsStats) else None
    capacity = int(snap.num_blocks) if snap is not None else 0
    stats = EngineStats(
        **tier_counts(snap, e.config.eviction_policy),
        block_nbytes=(
            int(e.spec.kv_bytes_per_offloaded_block or 0)
            if isinstance(e.spec, SizesOffloadedBlocks)
            else 0
        ),
        **vars(e._totals),
        reuse_filter_skipped_blocks=(
            int(manager.stores_skipped) if isinstance(manager, SkipsStores) else 0
        ),
        transfer_bytes=dict(e._bytes),
        transfer_seconds=dict(e._seconds),
        transfer_duration={
            d: Histogram(h.bounds, list(h.counts), h.sum, h.count) for d, h in e._durations.items()
        },
        transfers_in_flight=e._poller.in_flight if e._poller is not None else 0,
        leases_active=len(e._leases),
        leases_expired=dict(e._leases.expired),
        event_subscribers=e._hub.subscribers,
        events_published=e._hub.published,
        events_dropped=e._hub.dropped,
        last_event_seq=e._hub.last_seq,
    )
    if e._kv_events is not None:
        stats.kv_events = e._kv_events.stats()
    stats.observer_dropped_requests = e._observers.dropped_requests
    mrc = e._observers.mrc_stats(capacity)
    if mrc is not None:
        ratios, sampled = mrc
        stats.mrc_hit_ratio = dict(ratios)
        stats.mrc_sampled_keys = int(sampled)
    if e._tiers is not None:
        stats.tiers = e._tiers.tier_set.stats()
        stats.tier_write_queue_depth = e._tiers.tier_set.queue_depth
        stats.tier_promoted_blocks = e._tiers.promoted_blocks
        stats.tier_write_queue_full_blocks = e._tiers.tier_set.queue_full_blocks
        stats.tier_write_backpressure_waits = e._tiers.backpressure_waits
        stats.tier_write_backpressure_timeouts = e._tiers.backpressure_timeouts
    shadow = e._observers.shadow_stats()
    if shadow is not None:
        stats.shadow_live_policy = str(shadow.live)
        stats.shadow_hit_blocks = dict(shadow.hit_blocks)
        stats.shadow_sampled_blocks = int(shadow.sampled_blocks)
    return stats
