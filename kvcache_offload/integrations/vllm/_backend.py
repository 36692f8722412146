"""This library's CPU tier behind a vLLM spec: manager, handlers for vLLM's KV tensors, clean-up.

vLLM calls ``shutdown`` on handlers and managers but never on a spec, so the spec's resources
(handler threads, pinned buffers, a shared ``/dev/shm`` region) are released by a finalizer
that runs at the latest when the process exits.
"""

from __future__ import annotations

import weakref
from typing import Any

from kvcache_offload.config import OffloadConfig
from kvcache_offload.contracts.handler import OffloadingHandler
from kvcache_offload.contracts.manager import OffloadingManager
from kvcache_offload.dataplane.spec import CPUOffloadingSpec
from kvcache_offload.integrations.vllm._translate import canonical_kv_caches

__all__ = ["OffloadBackend"]


class OffloadBackend:
    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        self.spec = CPUOffloadingSpec(config, config.layout)
        self._handlers: tuple[OffloadingHandler, OffloadingHandler] | None = None
        self._finalizer = weakref.finalize(self, self.spec.shutdown)

    @property
    def num_blocks(self) -> int:
        return self.spec.num_blocks

    def manager(self) -> OffloadingManager:
        return self.spec.get_manager()

    def handlers(
        self, vllm_kv_caches: Any, rank: int | None = None
    ) -> tuple[OffloadingHandler, OffloadingHandler]:
        """(store handler, load handler) over vLLM's canonical KV caches (built once).

        ``rank`` is this worker's cell in a shared region (needed with several workers).
        """
        if self._handlers is not None:
            return self._handlers
        by_direction = {
            (src.medium(), dst.medium()): handler
            for src, dst, handler in self.spec.get_handlers(
                canonical_kv_caches(vllm_kv_caches), rank=rank
            )
        }
        self._handlers = by_direction[("GPU", "CPU")], by_direction[("CPU", "GPU")]
        return self._handlers

    def shutdown(self) -> None:
        """Stop handlers and release memory and the region; idempotent."""
        self._finalizer()
