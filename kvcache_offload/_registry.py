"""One lazy registry for everything chosen by name: policies, specs, CLI commands.

A name maps to a ``"package.module:Name"`` string that is imported on first use, so an unused
entry costs nothing; names not registered may be given as such a path directly. Each
registry checks what it loads (a policy must be a ``CachePolicy`` subclass, and so on) and
raises its own typed error for unknown names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from kvcache_offload._imports import import_object
from kvcache_offload.errors import ConfigError, OffloadError

__all__ = ["LazyRegistry"]

T = TypeVar("T")


class LazyRegistry(Generic[T]):
    """Name -> "module:Name", imported and checked on first use (then cached)."""

    def __init__(
        self,
        kind: str,
        check: Callable[[object, str], T],
        unknown: type[OffloadError],
        *,
        case_insensitive: bool = False,
    ) -> None:
        self.kind = kind
        self._check = check
        self._unknown = unknown
        self._fold = str.lower if case_insensitive else (lambda s: s)
        self._targets: dict[str, str] = {}
        self._loaded: dict[str, T] = {}

    def register(self, name: str, target: str) -> None:
        """Register ``target`` ("package.module:Name") under ``name``; imported on first use."""
        key = self._fold(name)
        if key in self._targets:
            raise ConfigError(f"{self.kind} {name!r} is already registered")
        self._targets[key] = target

    def unregister(self, name: str) -> None:
        """Remove a registration (tests and plugins replacing a built-in)."""
        key = self._fold(name)
        self._targets.pop(key, None)
        self._loaded.pop(key, None)

    def snapshot(self) -> dict[str, str]:
        """The registrations, for :meth:`restore` (tests that register temporary entries)."""
        return dict(self._targets)

    def restore(self, snapshot: dict[str, str]) -> None:
        self._targets = dict(snapshot)
        self._loaded.clear()

    def names(self) -> list[str]:
        return sorted(self._targets)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._fold(name) in self._targets

    def get(self, name: str) -> T:
        """The registered object, or one loaded from a "module:Name" path given as the name."""
        if not isinstance(name, str) or not name:
            raise self._unknown(f"{self.kind} must be a non-empty string, got {name!r}")
        key = self._fold(name)
        if key in self._loaded:
            return self._loaded[key]
        target = self._targets.get(key)
        if target is None:
            if "." in name or ":" in name:
                return self.load(name, name)
            raise self._unknown(
                f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())} "
                "(or give 'package.module:Name')"
            )
        obj = self.load(target, name)
        self._loaded[key] = obj
        return obj

    def load(self, path: str, name: str) -> T:
        """Import ``path`` and check it, as ``name``; import failures raise the typed error."""
        try:
            obj = import_object(path)
        except (ImportError, AttributeError) as exc:
            raise self._unknown(f"cannot load {self.kind} {name!r}: {exc}") from exc
        return self._check(obj, name)
