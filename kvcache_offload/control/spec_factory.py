"""Name -> OffloadingSpec class, imported lazily; unregistered specs load by module path."""

from __future__ import annotations

from typing import ClassVar

from kvcache_offload._registry import LazyRegistry
from kvcache_offload.config import KVCacheLayout, OffloadConfig
from kvcache_offload.contracts.spec import OffloadingSpec
from kvcache_offload.errors import UnknownSpecError

__all__ = ["OffloadingSpecFactory"]


def _checked(obj: object, name: str) -> type[OffloadingSpec]:
    if not (isinstance(obj, type) and issubclass(obj, OffloadingSpec)):
        raise UnknownSpecError(f"spec {name!r} resolves to {obj!r}, not an OffloadingSpec")
    return obj


class OffloadingSpecFactory:
    """vLLM's factory API over the project's one lazy registry."""

    _registry: ClassVar[LazyRegistry[type[OffloadingSpec]]] = LazyRegistry(
        "spec", _checked, UnknownSpecError
    )

    @classmethod
    def register_spec(cls, name: str, module_path: str, class_name: str) -> None:
        """Register a spec class imported from ``module_path`` on first use."""
        cls._registry.register(name, f"{module_path}:{class_name}")

    @classmethod
    def unregister_spec(cls, name: str) -> None:
        cls._registry.unregister(name)

    @classmethod
    def registered(cls) -> list[str]:
        return cls._registry.names()

    @classmethod
    def get_spec_cls(cls, config: OffloadConfig) -> type[OffloadingSpec]:
        name = config.spec_name
        if name in cls._registry:
            return cls._registry.get(name)
        if not config.spec_module_path:
            raise UnknownSpecError(
                f"unsupported spec type {name!r}: not registered ({', '.join(cls.registered())}) "
                "and no spec_module_path given"
            )
        return cls._registry.load(f"{config.spec_module_path}:{name}", name)

    @classmethod
    def create_spec(
        cls, config: OffloadConfig, layout: KVCacheLayout | None = None
    ) -> OffloadingSpec:
        """Instantiate the configured spec for ``layout`` (default: ``config.layout``)."""
        return cls.get_spec_cls(config)(config, layout or config.layout)


OffloadingSpecFactory.register_spec(
    "CPUOffloadingSpec", "kvcache_offload.dataplane.spec", "CPUOffloadingSpec"
)
