"""CPU-side load/store spec: block ids are CPU slot indices, one per offloaded block."""

from __future__ import annotations

from kvcache_offload.base import BlockIDsLoadStoreSpec

__all__ = ["CPULoadStoreSpec"]


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    @staticmethod
    def medium() -> str:
        return "CPU"
