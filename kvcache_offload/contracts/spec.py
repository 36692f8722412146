"""The offloading spec: ties a configuration to a manager and to worker-side handlers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
from kvcache_offload.contracts.load_store_spec import LoadStoreSpec
from kvcache_offload.contracts.manager import OffloadingManager
from kvcache_offload.errors import ConfigError

if TYPE_CHECKING:
    from kvcache_offload.config import KVCacheLayout, OffloadConfig
    from kvcache_offload.contracts.handler import OffloadingHandler

__all__ = ["OffloadingSpec"]


class OffloadingSpec(ABC):
    """Ties a configuration to a manager (scheduler side) and handlers (worker side).

    ``layout`` describes the GPU KV cache; ``block_size_factor`` is how many GPU blocks one
    offloaded block holds.
    """

    def __init__(self, config: OffloadConfig, layout: KVCacheLayout) -> None:
        self.config = config
        self.layout = layout
        gpu_block_sizes = tuple(layout.gpu_block_sizes)
        if not gpu_block_sizes:
            raise ConfigError("layout.gpu_block_sizes must name at least one KV-cache group")
        self.gpu_block_size: tuple[int, ...] = gpu_block_sizes
        self.block_size_factor = 1
        if config.block_size is not None:
            if len(set(gpu_block_sizes)) != 1:
                raise ConfigError(
                    f"block_size={config.block_size} needs all KV-cache groups to share one GPU "
                    f"block size, got {gpu_block_sizes}"
                )
            gpu = gpu_block_sizes[0]
            if config.block_size % gpu:
                raise ConfigError(
                    f"offloaded block_size={config.block_size} must be a multiple of the GPU "
                    f"block size {gpu}"
                )
            self.block_size_factor = config.block_size // gpu

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager (created once, then cached)."""

    @abstractmethod
    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        """Worker-side handlers as (source spec class, destination spec class, handler)."""
