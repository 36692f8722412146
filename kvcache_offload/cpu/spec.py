"""CPUOffloadingSpec: sizes the CPU tier and builds its manager and GPU<->CPU handlers.

Sizing follows vLLM: ``cpu_bytes_to_use`` is the total over all workers; one offloaded block
holds ``block_size_factor`` GPU blocks of every worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvcache_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingSpec,
)
from kvcache_offload.config import KVCacheLayout, OffloadConfig
from kvcache_offload.cpu.manager import CPUOffloadingManager
from kvcache_offload.reuse_manager import FilterReusedOffloadingManager

if TYPE_CHECKING:
    from kvcache_offload.worker.worker import OffloadingHandler

__all__ = ["CPUOffloadingSpec"]


class CPUOffloadingSpec(OffloadingSpec):
    def __init__(self, config: OffloadConfig, layout: KVCacheLayout) -> None:
        super().__init__(config, layout)
        kv_bytes_per_block = layout.bytes_per_block * layout.world_size
        self.kv_bytes_per_offloaded_block = kv_bytes_per_block * self.block_size_factor
        self.num_blocks = int(config.cpu_bytes_to_use) // self.kv_bytes_per_offloaded_block
        self.cpu_page_size_per_worker = self.kv_bytes_per_offloaded_block // layout.world_size
        self._manager: OffloadingManager | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            manager: OffloadingManager = CPUOffloadingManager(
                self.num_blocks,
                cache_policy=self.config.eviction_policy,
                enable_events=self.config.enable_events,
            )
            if self.config.store_threshold >= 2:
                manager = FilterReusedOffloadingManager(
                    manager,
                    store_threshold=self.config.store_threshold,
                    max_tracker_size=self.config.max_tracker_size,
                )
            self._manager = manager
        return self._manager

    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        # Filled in by the data plane (cpu/gpu_worker.py).
        raise NotImplementedError
