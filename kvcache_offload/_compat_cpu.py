"""What ``kvcache_offload.cpu`` exported before the renovation (deprecated path)."""

import importlib
from typing import Any

from kvcache_offload._moved import new_name
from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec
from kvcache_offload.control.manager import CPUManagerStats, CPUOffloadingManager
from kvcache_offload.dataplane.memory.block_memory import (
    BlockMemory,
    HostBlockMemory,
    RegionBlockMemory,
    TensorBlockMemory,
)

__path__: list[str] = []  # lets the old submodule paths resolve through the alias finder

__all__ = [
    "BlockMemory",
    "CPULoadStoreSpec",
    "CPUManagerStats",
    "CPUOffloadingManager",
    "HostBlockMemory",
    "RegionBlockMemory",
    "TensorBlockMemory",
]


def __getattr__(name: str) -> Any:
    """Old submodules (``from kvcache_offload.cpu import submodule``) through the alias table."""
    new = new_name(f"kvcache_offload.cpu.{name}")
    if new is None or new == __name__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return importlib.import_module(new)
    except ModuleNotFoundError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
