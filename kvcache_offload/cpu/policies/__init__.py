"""Eviction policies for the CPU tier (pure Python, no torch)."""

from kvcache_offload.cpu.policies.alru import AdaptiveLRUCachePolicy
from kvcache_offload.cpu.policies.arc import ARCCachePolicy
from kvcache_offload.cpu.policies.base import BlockStatus, CachePolicy
from kvcache_offload.cpu.policies.lru import LRUCachePolicy
from kvcache_offload.cpu.policies.registry import (
    available_cache_policies,
    get_cache_policy_cls,
    register_cache_policy,
    unregister_cache_policy,
)
from kvcache_offload.cpu.policies.s3fifo import PrefixS3FIFOCachePolicy, S3FIFOCachePolicy
from kvcache_offload.cpu.policies.sieve import SIEVECachePolicy
from kvcache_offload.cpu.policies.slru import SLRUCachePolicy

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
