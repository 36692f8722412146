"""Secondary tiers below the CPU tier (local disk, shared Redis/Valkey, object store) behind
one contract.

The CPU tier stays primary: GPU transfers only ever touch it. Blocks go down to these tiers
(write-through or write-back) and come back up into a CPU slot before a load.

The tier implementations need the ``tiers`` extra (``redis``, ``xxhash``, ``obstore``); they
are imported on first use, so importing the engine never needs them when no tier is configured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache_offload._imports import lazy_exports
from kvcache_offload.tiers.base import LatencyHistogram, SecondaryTier, TierStats

if TYPE_CHECKING:
    from kvcache_offload.tiers.configured import tiers_from_config
    from kvcache_offload.tiers.disk import DiskTier
    from kvcache_offload.tiers.fingerprint import layout_fingerprint
    from kvcache_offload.tiers.object_tier import ObjectTier
    from kvcache_offload.tiers.redis_tier import RedisTier
    from kvcache_offload.tiers.tier_set import TierSet

__all__ = [
    "DiskTier",
    "LatencyHistogram",
    "ObjectTier",
    "RedisTier",
    "SecondaryTier",
    "TierSet",
    "TierStats",
    "layout_fingerprint",
    "tiers_from_config",
]

_LAZY = {
    "DiskTier": "kvcache_offload.tiers.disk",
    "ObjectTier": "kvcache_offload.tiers.object_tier",
    "RedisTier": "kvcache_offload.tiers.redis_tier",
    "TierSet": "kvcache_offload.tiers.tier_set",
    "layout_fingerprint": "kvcache_offload.tiers.fingerprint",
    "tiers_from_config": "kvcache_offload.tiers.configured",
}

__getattr__ = lazy_exports(__name__, _LAZY)
