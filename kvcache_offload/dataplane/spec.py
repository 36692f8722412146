"""CPUOffloadingSpec: sizes the CPU tier and builds its manager, handlers and block memory.

Sizing follows vLLM: ``cpu_bytes_to_use`` is the total over all workers; one offloaded block
holds ``block_size_factor`` GPU blocks of every worker.

Worker side (:meth:`get_handlers`): the CUDA handlers (``cpu/gpu_worker.py``) when the KV
tensors are on a GPU, the CPU backend (``cpu/cpu_backend.py``) when they are CPU tensors;
``config.backend`` ("auto", "cuda", "cpu") can insist on one. With ``config.shared_region``
the CPU copies live in a :class:`SharedOffloadRegion` named ``config.region_name`` that
other processes of the same host can map. Torch is imported only here, lazily.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvcache_offload.config import KVCacheLayout, OffloadConfig
from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
from kvcache_offload.contracts.load_store_spec import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
)
from kvcache_offload.contracts.manager import OffloadingManager
from kvcache_offload.contracts.spec import OffloadingSpec
from kvcache_offload.control.manager import CPUOffloadingManager
from kvcache_offload.control.reuse_filter import FilterReusedOffloadingManager
from kvcache_offload.dataplane.memory.block_memory import (
    BlockMemory,
    HostBlockMemory,
    RegionBlockMemory,
    TensorBlockMemory,
)
from kvcache_offload.errors import ConfigError

if TYPE_CHECKING:
    from kvcache_offload.contracts.handler import OffloadingHandler
    from kvcache_offload.dataplane.memory.shared_offload_region import SharedOffloadRegion

__all__ = ["DEFAULT_REGION_NAME", "CPUOffloadingSpec", "cuda_handler_options"]

logger = logging.getLogger(__name__)

DEFAULT_REGION_NAME = "default"


def cuda_handler_options(config: OffloadConfig) -> dict[str, Any]:
    """The keyword arguments of ``CpuGpuOffloadingHandlers`` that come from ``config``."""
    t = config.transfer
    return {
        "mechanism": t.mechanism,
        "staged_when_busy": t.staged_when_busy,
        "staged_one_way_min_load_bytes": int(t.staged_one_way_min_load_bytes),
        "staged_one_way_min_store_bytes": int(t.staged_one_way_min_store_bytes),
        "staged_mixed_min_job_bytes": int(t.staged_mixed_min_job_bytes),
        "staged_min_job_bytes": int(t.staged_min_job_bytes),
        "staged_lone_min_load_bytes": int(t.staged_lone_min_load_bytes),
        "batch_min_bytes": int(t.batch_min_bytes),
        "batch_max_bytes": int(t.batch_max_bytes),
    }


class CPUOffloadingSpec(OffloadingSpec):
    def __init__(self, config: OffloadConfig, layout: KVCacheLayout) -> None:
        super().__init__(config, layout)
        kv_bytes_per_block = layout.bytes_per_block * layout.world_size
        self.kv_bytes_per_offloaded_block = kv_bytes_per_block * self.block_size_factor
        self.num_blocks = int(config.cpu_bytes_to_use) // self.kv_bytes_per_offloaded_block
        self.cpu_page_size_per_worker = self.kv_bytes_per_offloaded_block // layout.world_size
        self._manager: OffloadingManager | None = None
        self._handlers: Any = None
        self._region: SharedOffloadRegion | None = None
        self._block_memory: BlockMemory | None = None
        self._memory_lock = threading.Lock()

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

    # -- worker side -------------------------------------------------------------------------
    def get_handlers(
        self, kv_caches: CanonicalKVCaches, *, rank: int | None = None
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        """(GPU spec, CPU spec, store handler) then (CPU spec, GPU spec, load handler).

        ``rank`` is this worker's index in a shared region (default 0 with one worker).
        Built once and cached; later calls yield the same handlers.
        """
        handlers = self.build_handlers(kv_caches, rank=rank)
        yield GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu_handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu_handler

    def build_handlers(self, kv_caches: CanonicalKVCaches, *, rank: int | None = None) -> Any:
        """The handler pair object (``CpuGpuOffloadingHandlers`` or the CPU backend's)."""
        if self._handlers is not None:
            return self._handlers
        if not kv_caches.tensors:
            raise ConfigError("get_handlers needs at least one canonical KV tensor")
        on_cuda = kv_caches.tensors[0].tensor.device.type == "cuda"
        backend = self.config.backend
        if backend == "auto":
            backend = "cuda" if on_cuda else "cpu"
        if backend == "cuda" and not on_cuda:
            raise ConfigError("backend 'cuda' needs the KV tensors on a CUDA device")
        if backend == "cpu" and on_cuda:
            raise ConfigError(
                "backend 'cpu' needs CPU KV tensors, got CUDA ones (use 'auto' or 'cuda')"
            )
        need = sum(int(t.page_size_bytes) for t in kv_caches.tensors) * self.block_size_factor
        if need != self.cpu_page_size_per_worker:
            if self.config.shared_region and need > self.cpu_page_size_per_worker:
                raise ConfigError(
                    f"the KV caches need {need} bytes per offloaded block on this worker, but "
                    f"the shared region is sized from layout.bytes_per_block="
                    f"{self.layout.bytes_per_block} ({self.cpu_page_size_per_worker} bytes per "
                    f"cell); set layout.bytes_per_block to "
                    f"{need // self.block_size_factor}"
                )
            logger.warning(
                "layout.bytes_per_block=%d but the KV caches hold %d bytes per GPU block: "
                "%d CPU slots hold %d bytes each (cpu_bytes_to_use is not met exactly)",
                self.layout.bytes_per_block,
                need // self.block_size_factor,
                self.num_blocks,
                need,
            )
        region = None
        if self.config.shared_region:
            if rank is None:
                if self.layout.world_size != 1:
                    raise ConfigError(
                        f"a shared region with world_size={self.layout.world_size} needs this "
                        "worker's rank: get_handlers(kv_caches, rank=...)"
                    )
                rank = 0
            region = self.get_region(rank)
        if backend == "cuda":
            from kvcache_offload.dataplane.handlers.cuda import CpuGpuOffloadingHandlers

            self._handlers = CpuGpuOffloadingHandlers(
                kv_caches,
                self.block_size_factor,
                self.num_blocks,
                region,
                **cuda_handler_options(self.config),
            )
        else:
            from kvcache_offload.dataplane.handlers.cpu_backend import CpuBackendOffloadingHandlers

            self._handlers = CpuBackendOffloadingHandlers(
                kv_caches, self.block_size_factor, self.num_blocks, region
            )
        return self._handlers

    def get_region(self, rank: int | None = None) -> SharedOffloadRegion:
        """Create or join the shared region (blocking file and mmap work: call off-loop).

        ``rank=None`` maps every row without a cell of its own (the sidecar service); the
        region then expects ``world_size + 1`` mappers before its file is unlinked.
        """
        if self._region is None:
            from kvcache_offload.dataplane.memory import shared_offload_region

            self._region = shared_offload_region.SharedOffloadRegion(
                self.config.region_name or DEFAULT_REGION_NAME,
                num_blocks=self.num_blocks,
                cpu_page_size=self.cpu_page_size_per_worker,
                num_workers=self.layout.world_size,
                rank=rank,
                shm_dir=shared_offload_region.DEFAULT_SHM_DIR,
            )
        elif rank is not None and self._region.rank != rank:
            raise ConfigError(
                f"this spec already mapped the region as rank {self._region.rank}, not {rank}"
            )
        return self._region

    def get_block_memory(self) -> BlockMemory:
        """Byte access to offloaded blocks by slot id (remote clients, the HTTP layer).

        The shared region's whole rows when there is one; else the handlers' CPU tensors
        (so uploaded blocks are loadable); else a private host buffer of
        ``kv_bytes_per_offloaded_block`` bytes per slot (a service without KV tensors).
        """
        with self._memory_lock:  # two callers at once (e.g. the tier writer) map one region
            return self._get_block_memory_locked()

    def _get_block_memory_locked(self) -> BlockMemory:
        if self._block_memory is None:
            if self._region is not None or self.config.shared_region:
                # Closing the block memory (the engine does on aclose) releases the region.
                self._block_memory = RegionBlockMemory(self.get_region(None), owns_region=True)
            elif self._handlers is not None:
                self._block_memory = TensorBlockMemory(self._handlers.cpu_tensors)
            else:
                self._block_memory = HostBlockMemory(
                    self.num_blocks, self.kv_bytes_per_offloaded_block
                )
        return self._block_memory

    def shutdown(self) -> None:
        """Stop the handlers, release block memory and the region. Idempotent."""
        handlers, self._handlers = self._handlers, None
        if handlers is not None:
            handlers.shutdown()
            del handlers
        memory, self._block_memory = self._block_memory, None
        if memory is not None:
            memory.close()
        region, self._region = self._region, None
        if region is not None:
            region.cleanup()
        if self._manager is not None:
            self._manager.shutdown()
