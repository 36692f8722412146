"""Secondary tiers below the CPU tier (local disk, shared Redis/Valkey) behind one contract.

The CPU tier stays primary: GPU transfers only ever touch it. Blocks go down to these tiers
(write-through or write-back) and come back up into a CPU slot before a load.
"""

from kvcache_offload.tiers.base import LatencyHistogram, SecondaryTier, TierStats
from kvcache_offload.tiers.configured import tiers_from_config
from kvcache_offload.tiers.disk import DiskTier
from kvcache_offload.tiers.fingerprint import layout_fingerprint
from kvcache_offload.tiers.redis_tier import RedisTier
from kvcache_offload.tiers.tier_set import TierSet

__all__ = [
    "DiskTier",
    "LatencyHistogram",
    "RedisTier",
    "SecondaryTier",
    "TierSet",
    "TierStats",
    "layout_fingerprint",
    "tiers_from_config",
]
