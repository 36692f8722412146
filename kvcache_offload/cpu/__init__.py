"""The CPU tier: manager, load/store spec, policies, handlers and the shared region."""

from kvcache_offload.cpu.common import CPULoadStoreSpec
from kvcache_offload.cpu.manager import CPUManagerStats, CPUOffloadingManager

__all__ = ["CPULoadStoreSpec", "CPUManagerStats", "CPUOffloadingManager"]
