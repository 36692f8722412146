"""The secondary tiers a configuration asks for, in their fixed order: disk, Redis, object store.

Disk comes first because it is local: a lookup or load asks it before paying a network round
trip, and a block the disk evicted may still be in the shared Redis tier. The object store
comes last: the largest and slowest (a request costs milliseconds to tens of them), it holds
what the tiers above have evicted.
"""

from __future__ import annotations

from kvcache_offload.config import OffloadConfig
from kvcache_offload.tiers.base import SecondaryTier

__all__ = ["tiers_from_config"]


def tiers_from_config(config: OffloadConfig, fingerprint: str) -> list[SecondaryTier]:
    """The configured tiers (empty when none of ``disk_path``, ``remote_url`` and
    ``object_url`` is set)."""
    tiers: list[SecondaryTier] = []
    if config.disk_path is not None:
        from kvcache_offload.tiers.disk import DiskTier

        tiers.append(DiskTier(config.disk_path, int(config.disk_bytes), fingerprint))
    if config.remote_url:
        from kvcache_offload.tiers.redis_tier import RedisTier

        tiers.append(RedisTier(config.remote_url, fingerprint))
    if config.object_url:
        from kvcache_offload.tiers.object_tier import ObjectTier

        budget = config.object_bytes
        tiers.append(
            ObjectTier(
                config.object_url,
                fingerprint,
                endpoint=config.object_endpoint,
                capacity_bytes=None if budget is None else int(budget),
                concurrency=config.object_concurrency,
                refresh_s=config.object_refresh_s,
                read_timeout_s=config.object_read_timeout_s,
            )
        )
    return tiers
