"""Name -> policy class, with lazy imports so unused policies cost nothing.

Out-of-tree policies load by "package.module:ClassName" without registering first.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcache_offload._imports import import_object
from kvcache_offload.cpu.policies.base import CachePolicy
from kvcache_offload.errors import ConfigError, UnknownPolicyError

__all__ = [
    "available_cache_policies",
    "get_cache_policy_cls",
    "register_cache_policy",
]

_registry: dict[str, Callable[[], type[CachePolicy]]] = {}


def register_cache_policy(name: str, module_path: str, class_name: str) -> None:
    """Register a policy class to be imported from ``module_path`` on first use."""
    key = name.lower()
    if key in _registry:
        raise ConfigError(f"cache policy {name!r} is already registered")

    def load() -> type[CachePolicy]:
        return _checked(import_object(f"{module_path}:{class_name}"), name)

    _registry[key] = load


def unregister_cache_policy(name: str) -> None:
    """Remove a registration (tests and plugins replacing a built-in)."""
    _registry.pop(name.lower(), None)


def available_cache_policies() -> list[str]:
    return sorted(_registry)


def get_cache_policy_cls(name: str) -> type[CachePolicy]:
    """The class registered as ``name``, or imported from a "module:Class" path."""
    if not isinstance(name, str) or not name:
        raise UnknownPolicyError(f"cache policy must be a non-empty string, got {name!r}")
    loader = _registry.get(name.lower())
    if loader is not None:
        return loader()
    if "." in name or ":" in name:
        try:
            return _checked(import_object(name), name)
        except (ImportError, AttributeError) as exc:
            raise UnknownPolicyError(f"cannot load cache policy {name!r}: {exc}") from exc
    raise UnknownPolicyError(
        f"unknown cache policy {name!r}; registered: {', '.join(available_cache_policies())} "
        "(or give 'package.module:ClassName')"
    )


def _checked(obj: object, name: str) -> type[CachePolicy]:
    if not (isinstance(obj, type) and issubclass(obj, CachePolicy)):
        raise UnknownPolicyError(f"{name!r} resolves to {obj!r}, which is not a CachePolicy")
    return obj


_BUILTIN = {
    "lru": ("kvcache_offload.cpu.policies.lru", "LRUCachePolicy"),
    "arc": ("kvcache_offload.cpu.policies.arc", "ARCCachePolicy"),
    "alru": ("kvcache_offload.cpu.policies.alru", "AdaptiveLRUCachePolicy"),
    "s3fifo": ("kvcache_offload.cpu.policies.s3fifo", "S3FIFOCachePolicy"),
    "s3fifo-prefix": ("kvcache_offload.cpu.policies.s3fifo", "PrefixS3FIFOCachePolicy"),
    "sieve": ("kvcache_offload.cpu.policies.sieve", "SIEVECachePolicy"),
    "slru": ("kvcache_offload.cpu.policies.slru", "SLRUCachePolicy"),
}
for _name, (_module, _cls) in _BUILTIN.items():
    register_cache_policy(_name, _module, _cls)
