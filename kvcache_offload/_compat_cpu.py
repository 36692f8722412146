"""What ``kvcache_offload.cpu`` exported before the renovation (deprecated path)."""

from kvcache_offload._moved import old_submodules
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


__getattr__ = old_submodules("kvcache_offload.cpu")
