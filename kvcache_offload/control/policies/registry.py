"""Name -> policy class, with lazy imports so unused policies cost nothing.

Out-of-tree policies load by "package.module:ClassName" without registering first.
"""

from __future__ import annotations

from kvcache_offload._registry import LazyRegistry
from kvcache_offload.control.policies.base import CachePolicy
from kvcache_offload.errors import UnknownPolicyError

__all__ = [
    "available_cache_policies",
    "get_cache_policy_cls",
    "register_cache_policy",
]


def _checked(obj: object, name: str) -> type[CachePolicy]:
    if not (isinstance(obj, type) and issubclass(obj, CachePolicy)):
        raise UnknownPolicyError(f"{name!r} resolves to {obj!r}, which is not a CachePolicy")
    return obj


POLICIES: LazyRegistry[type[CachePolicy]] = LazyRegistry(
    "cache policy", _checked, UnknownPolicyError, case_insensitive=True
)


def register_cache_policy(name: str, module_path: str, class_name: str) -> None:
    """Register a policy class to be imported from ``module_path`` on first use."""
    POLICIES.register(name, f"{module_path}:{class_name}")


def unregister_cache_policy(name: str) -> None:
    """Remove a registration (tests and plugins replacing a built-in)."""
    POLICIES.unregister(name)


def available_cache_policies() -> list[str]:
    return POLICIES.names()


def get_cache_policy_cls(name: str) -> type[CachePolicy]:
    """The class registered as ``name``, or imported from a "module:Class" path."""
    return POLICIES.get(name)


_BUILTIN = {
    "lru": ("kvcache_offload.control.policies.lru", "LRUCachePolicy"),
    "arc": ("kvcache_offload.control.policies.arc", "ARCCachePolicy"),
    "alru": ("kvcache_offload.control.policies.alru", "AdaptiveLRUCachePolicy"),
    "s3fifo": ("kvcache_offload.control.policies.s3fifo", "S3FIFOCachePolicy"),
    "s3fifo-prefix": ("kvcache_offload.control.policies.s3fifo", "PrefixS3FIFOCachePolicy"),
    "sieve": ("kvcache_offload.control.policies.sieve", "SIEVECachePolicy"),
    "slru": ("kvcache_offload.control.policies.slru", "SLRUCachePolicy"),
    "lru2": ("kvcache_offload.control.policies.lru2", "LRU2CachePolicy"),
    "adaptive": ("kvcache_offload.control.policies.adaptive", "AdaptiveCachePolicy"),
}
for _name, (_module, _cls) in _BUILTIN.items():
    register_cache_policy(_name, _module, _cls)
