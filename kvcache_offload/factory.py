"""Name -> OffloadingSpec class, imported lazily; unregistered specs load by module path."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import ClassVar

from kvcache_offload.base import OffloadingSpec
from kvcache_offload.config import KVCacheLayout, OffloadConfig
from kvcache_offload.errors import ConfigError, UnknownSpecError

__all__ = ["OffloadingSpecFactory"]


class OffloadingSpecFactory:
    _registry: ClassVar[dict[str, Callable[[], type[OffloadingSpec]]]] = {}

    @classmethod
    def register_spec(cls, name: str, module_path: str, class_name: str) -> None:
        """Register a spec class imported from ``module_path`` on first use."""
        if name in cls._registry:
            raise ConfigError(f"spec {name!r} is already registered")

        def load() -> type[OffloadingSpec]:
            module = importlib.import_module(module_path)
            return _checked(getattr(module, class_name), name)

        cls._registry[name] = load

    @classmethod
    def unregister_spec(cls, name: str) -> None:
        cls._registry.pop(name, None)

    @classmethod
    def registered(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def get_spec_cls(cls, config: OffloadConfig) -> type[OffloadingSpec]:
        name = config.spec_name
        loader = cls._registry.get(name)
        if loader is not None:
            return loader()
        if not config.spec_module_path:
            raise UnknownSpecError(
                f"unsupported spec type {name!r}: not registered ({', '.join(cls.registered())}) "
                "and no spec_module_path given"
            )
        try:
            module = importlib.import_module(config.spec_module_path)
            spec_cls = getattr(module, name)
        except (ImportError, AttributeError) as exc:
            raise UnknownSpecError(
                f"cannot load spec {name!r} from {config.spec_module_path!r}: {exc}"
            ) from exc
        return _checked(spec_cls, name)

    @classmethod
    def create_spec(
        cls, config: OffloadConfig, layout: KVCacheLayout | None = None
    ) -> OffloadingSpec:
        """Instantiate the configured spec for ``layout`` (default: ``config.layout``)."""
        return cls.get_spec_cls(config)(config, layout or config.layout)


def _checked(obj: object, name: str) -> type[OffloadingSpec]:
    if not (isinstance(obj, type) and issubclass(obj, OffloadingSpec)):
        raise UnknownSpecError(f"spec {name!r} resolves to {obj!r}, not an OffloadingSpec")
    return obj


OffloadingSpecFactory.register_spec(
    "CPUOffloadingSpec", "kvcache_offload.cpu.spec", "CPUOffloadingSpec"
)
