"""Old import paths of modules that moved (issue 12), kept working with a DeprecationWarning.

An old name resolves to the very module object of its new home (one module, one identity:
monkeypatching, isinstance and registries keep working), through a finder placed first on
``sys.meta_path``. The table is the map from the renovation; docs/architecture.md lists it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "install"]

MOVED: dict[str, str] = {
    "kvcache_offload.cpu.manager": "kvcache_offload.control.manager",
    "kvcache_offload.cpu.policies": "kvcache_offload.control.policies",
    "kvcache_offload.reuse_manager": "kvcache_offload.control.reuse_filter",
    "kvcache_offload.factory": "kvcache_offload.control.spec_factory",
    "kvcache_offload.cpu.spec": "kvcache_offload.dataplane.spec",
    "kvcache_offload.cpu.gpu_worker": "kvcache_offload.dataplane.handlers.cuda",
    "kvcache_offload.cpu.cpu_backend": "kvcache_offload.dataplane.handlers.cpu_backend",
    "kvcache_offload.cpu.copy": "kvcache_offload.dataplane.copy",
    "kvcache_offload.cpu.block_memory": "kvcache_offload.dataplane.memory.block_memory",
    "kvcache_offload.cpu.pinned_buffer": "kvcache_offload.dataplane.memory.pinned_buffer",
    "kvcache_offload.cpu.shared_offload_region": (
        "kvcache_offload.dataplane.memory.shared_offload_region"
    ),
    "kvcache_offload.cpu.layouts": "kvcache_offload.dataplane.layouts",
    "kvcache_offload.cpu.common": "kvcache_offload.contracts.load_store_spec",
    "kvcache_offload.cpu": "kvcache_offload._compat_cpu",
    "kvcache_offload.replay": "kvcache_offload.lab",
    "kvcache_offload.worker.worker": "kvcache_offload._compat_worker",
    "kvcache_offload.worker": "kvcache_offload._compat_worker",
}
"""Old dotted module (or package) -> its new home; submodules follow their package."""


def old_submodules(old_package: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` of a compat package: ``from OLD import submodule`` resolves
    the submodule through the alias table (``from`` imports look attributes up first)."""

    def __getattr__(name: str) -> Any:
        new = new_name(f"{old_package}.{name}")
        if new is None:
            raise AttributeError(f"module {old_package!r} has no attribute {name!r}")
        try:
            return importlib.import_module(new)
        except ModuleNotFoundError:
            raise AttributeError(f"module {old_package!r} has no attribute {name!r}") from None

    return __getattr__


def new_name(old: str) -> str | None:
    for prefix in sorted(MOVED, key=len, reverse=True):
        if old == prefix or old.startswith(prefix + "."):
            return MOVED[prefix] + old[len(prefix) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{self.old} moved to {self.new}; the old import path will be removed",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import system pointed it at the alias


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        found = importlib.util.find_spec(new)
        is_package = found is not None and found.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(fullname, new), is_package=is_package
        )


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
