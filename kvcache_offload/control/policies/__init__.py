"""Eviction policies for the CPU tier (pure Python, no torch), one module per algorithm.

The names below load on first use (PEP 562), so importing the package, or the registry,
imports no policy module the configuration does not ask for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache_offload._imports import lazy_exports
from kvcache_offload.control.policies.base import BlockStatus, CachePolicy
from kvcache_offload.control.policies.registry import (
    available_cache_policies,
    get_cache_policy_cls,
    register_cache_policy,
    unregister_cache_policy,
)

if TYPE_CHECKING:
    from kvcache_offload.control.policies.adaptive import AdaptiveCachePolicy
    from kvcache_offload.control.policies.alru import AdaptiveLRUCachePolicy
    from kvcache_offload.control.policies.arc import ARCCachePolicy
    from kvcache_offload.control.policies.lru import LRUCachePolicy
    from kvcache_offload.control.policies.lru2 import LRU2CachePolicy
    from kvcache_offload.control.policies.s3fifo import (
        PrefixS3FIFOCachePolicy,
        S3FIFOCachePolicy,
    )
    from kvcache_offload.control.policies.sieve import SIEVECachePolicy
    from kvcache_offload.control.policies.slru import SLRUCachePolicy

__all__ = [
    "ARCCachePolicy",
    "AdaptiveCachePolicy",
    "AdaptiveLRUCachePolicy",
    "BlockStatus",
    "CachePolicy",
    "LRU2CachePolicy",
    "LRUCachePolicy",
    "PrefixS3FIFOCachePolicy",
    "S3FIFOCachePolicy",
    "SIEVECachePolicy",
    "SLRUCachePolicy",
    "available_cache_policies",
    "get_cache_policy_cls",
    "register_cache_policy",
    "unregister_cache_policy",
]

_LAZY = {
    name: f"{__name__}.{module}"
    for name, module in {
        "AdaptiveCachePolicy": "adaptive",
        "AdaptiveLRUCachePolicy": "alru",
        "ARCCachePolicy": "arc",
        "LRUCachePolicy": "lru",
        "LRU2CachePolicy": "lru2",
        "PrefixS3FIFOCachePolicy": "s3fifo",
        "S3FIFOCachePolicy": "s3fifo",
        "SIEVECachePolicy": "sieve",
        "SLRUCachePolicy": "slru",
    }.items()
}
__getattr__ = lazy_exports(__name__, _LAZY)
