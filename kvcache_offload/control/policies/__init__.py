"""Eviction policies for the CPU tier (pure Python, no torch), one module per algorithm.

The names below load on first use (PEP 562), so importing the package, or the registry,
imports no policy module the configuration does not ask for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvcache_offload.control.policies.base import BlockStatus, CachePolicy
from kvcache_offload.control.policies.registry import (
    available_cache_policies,
    get_cache_policy_cls,
    register_cache_policy,
    unregister_cache_policy,
)

if TYPE_CHECKING:
    from kvcache_offload.control.policies.alru import AdaptiveLRUCachePolicy
    from kvcache_offload.control.policies.arc import ARCCachePolicy
    from kvcache_offload.control.policies.lru import LRUCachePolicy
    from kvcache_offload.control.policies.s3fifo import (
        PrefixS3FIFOCachePolicy,
        S3FIFOCachePolicy,
    )
    from kvcache_offload.control.policies.sieve import SIEVECachePolicy
    from kvcache_offload.control.policies.slru import SLRUCachePolicy

__all__ = [
    "ARCCachePolicy",
    "AdaptiveLRUCachePolicy",
    "BlockStatus",
    "CachePolicy",
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
    "AdaptiveLRUCachePolicy": "alru",
    "ARCCachePolicy": "arc",
    "LRUCachePolicy": "lru",
    "PrefixS3FIFOCachePolicy": "s3fifo",
    "S3FIFOCachePolicy": "s3fifo",
    "SIEVECachePolicy": "sieve",
    "SLRUCachePolicy": "slru",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
