"""Both directions over one set of CPU tensors: vLLM's ``CpuGpuOffloadingHandlers``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
from kvcache_offload.dataplane.copy.staged import DEFAULT_STAGING_CONFIG, StagingConfig
from kvcache_offload.dataplane.copy.triton_kernel import DEFAULT_KERNEL_CONFIG, KernelConfig
from kvcache_offload.dataplane.handlers.cpu_backend import (
    allocate_cpu_tensors,
    canonical_views_on,
)
from kvcache_offload.dataplane.handlers.cuda.handler import (
    DEFAULT_BATCH_MAX_BYTES,
    DEFAULT_BATCH_MIN_BYTES,
    SingleDirectionOffloadingHandler,
)
from kvcache_offload.dataplane.handlers.cuda.paths import (
    DEFAULT_STAGED_LONE_MAX_LOAD_BYTES,
    DEFAULT_STAGED_LONE_MIN_LOAD_BYTES,
    DEFAULT_STAGED_MIN_JOB_BYTES,
    DEFAULT_STAGED_MIXED_MIN_JOB_BYTES,
    DEFAULT_STAGED_ONE_WAY_MIN_LOAD_BYTES,
    DEFAULT_STAGED_ONE_WAY_MIN_STORE_BYTES,
    CompletionWait,
    Mechanism,
    StagedWhenBusy,
    staged_when_busy_per_direction,
)
from kvcache_offload.dataplane.handlers.handler_pair import HandlerPair

if TYPE_CHECKING:
    from kvcache_offload.dataplane.memory.shared_offload_region import SharedOffloadRegion

__all__ = ["CpuGpuOffloadingHandlers"]


class CpuGpuOffloadingHandlers(HandlerPair[SingleDirectionOffloadingHandler]):
    """The store (GPU->CPU) and load (CPU->GPU) handlers over one set of CPU tensors.

    ``cpu_tensors`` are pinned ``torch.zeros`` (one per canonical tensor, ``(num_cpu_blocks,
    gpu_page * block_size_factor)``) or views of ``mmap_region``, which is pinned (and mapped
    for the UVA kernel) here if it is not already; a pinning failure only warns.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        block_size_factor: int,
        num_cpu_blocks: int,
        mmap_region: SharedOffloadRegion | None = None,
        *,
        mechanism: Mechanism = "auto",
        kernel_config: KernelConfig = DEFAULT_KERNEL_CONFIG,
        staging: StagingConfig = DEFAULT_STAGING_CONFIG,
        staged_min_job_bytes: int = DEFAULT_STAGED_MIN_JOB_BYTES,
        staged_lone_min_load_bytes: int = DEFAULT_STAGED_LONE_MIN_LOAD_BYTES,
        staged_lone_max_load_bytes: int = DEFAULT_STAGED_LONE_MAX_LOAD_BYTES,
        completion_wait: CompletionWait = "blocking",
        pin_memory: bool = True,
        staged_when_busy: StagedWhenBusy = "mixed",
        staged_one_way_min_load_bytes: int = DEFAULT_STAGED_ONE_WAY_MIN_LOAD_BYTES,
        staged_one_way_min_store_bytes: int = DEFAULT_STAGED_ONE_WAY_MIN_STORE_BYTES,
        staged_mixed_min_job_bytes: int = DEFAULT_STAGED_MIXED_MIN_JOB_BYTES,
        batch_min_bytes: int = DEFAULT_BATCH_MIN_BYTES,
        batch_max_bytes: int = DEFAULT_BATCH_MAX_BYTES,
    ) -> None:
        self.gpu_tensors = canonical_views_on(
            kv_caches,
            "cuda",
            "CUDA handlers need CUDA tensors (use CpuBackendOffloadingHandlers for CPU ones)",
        )
        if mmap_region is not None and pin_memory and not mmap_region.is_pinned:
            mmap_region.pin()
        self.cpu_tensors = allocate_cpu_tensors(
            self.gpu_tensors, block_size_factor, num_cpu_blocks, mmap_region, pin_memory
        )
        kwargs: dict[str, Any] = {
            "mechanism": mechanism,
            "kernel_config": kernel_config,
            "staging": staging,
            "staged_min_job_bytes": staged_min_job_bytes,
            "completion_wait": completion_wait,
            "batch_min_bytes": batch_min_bytes,
            "batch_max_bytes": batch_max_bytes,
            "staged_mixed_min_job_bytes": staged_mixed_min_job_bytes,
        }
        busy_stores, busy_loads = staged_when_busy_per_direction(staged_when_busy)
        refs = kv_caches.group_data_refs
        self.gpu_to_cpu_handler = SingleDirectionOffloadingHandler(
            self.gpu_tensors,
            self.cpu_tensors,
            block_size_factor,
            refs,
            True,
            staged_when_busy=busy_stores,
            staged_one_way_min_job_bytes=staged_one_way_min_store_bytes,
            **kwargs,
        )
        self.cpu_to_gpu_handler = SingleDirectionOffloadingHandler(
            self.gpu_tensors,
            self.cpu_tensors,
            block_size_factor,
            refs,
            False,
            staged_when_busy=busy_loads,
            staged_one_way_min_job_bytes=staged_one_way_min_load_bytes,
            staged_auto_min_job_bytes=staged_lone_min_load_bytes,
            staged_lone_max_job_bytes=staged_lone_max_load_bytes,
            **kwargs,
        )
        if staged_when_busy == "mixed":
            self.gpu_to_cpu_handler.pair_with(self.cpu_to_gpu_handler)
