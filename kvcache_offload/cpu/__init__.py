"""The CPU tier: manager, load/store spec, policies, handlers and the shared region.

Torch-free names are exported here. The data-plane modules that need torch are imported by
their module path: ``kvcache_offload.cpu.gpu_worker`` (CUDA handlers),
``kvcache_offload.cpu.cpu_backend`` (CPU-tensor handlers), ``kvcache_offload.cpu.layouts``
(canonical KV-cache builders) and ``kvcache_offload.cpu.copy_kernels`` (copy paths).
"""

from kvcache_offload.cpu.block_memory import (
    BlockMemory,
    HostBlockMemory,
    RegionBlockMemory,
    TensorBlockMemory,
)
from kvcache_offload.cpu.common import CPULoadStoreSpec
from kvcache_offload.cpu.manager import CPUManagerStats, CPUOffloadingManager

__all__ = [
    "BlockMemory",
    "CPULoadStoreSpec",
    "CPUManagerStats",
    "CPUOffloadingManager",
    "HostBlockMemory",
    "RegionBlockMemory",
    "TensorBlockMemory",
]
