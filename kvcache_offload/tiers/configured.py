"""The secondary tiers a configuration asks for, in their fixed order: disk, then Redis.

Disk comes first because it is local: a lookup or load asks it before paying a network round
trip, and a block the disk evicted may still be in the shared Redis tier.
"""

from __future__ import annotations

from kvcache_offload.config import OffloadConfig
from kvcache_offload.tiers.base import SecondaryTier

__all__ = ["tiers_from_config"]


def tiers_from_config(config: OffloadConfig, fingerprint: str) -> list[SecondaryTier]:
    """The configured tiers (empty when neither ``disk_path`` nor ``remote_url`` is set)."""
    tiers: list[SecondaryTier] = []
    if config.disk_path is not None:
        from kvcache_offload.tiers.disk import DiskTier

        tiers.append(DiskTier(config.disk_path, int(config.disk_bytes), fingerprint))
    if config.remote_url:
        from kvcache_offload.tiers.redis_tier import RedisTier

        tiers.append(RedisTier(config.remote_url, fingerprint))
    return tiers
