"""The store and load handlers of one set of CPU tensors, owned and shut down together."""

from __future__ import annotations

from typing import Generic, TypeVar

from kvcache_offload.contracts.handler import OffloadingHandler

__all__ = ["HandlerPair"]

H = TypeVar("H", bound=OffloadingHandler)


class HandlerPair(Generic[H]):
    """Base of the CUDA and CPU-backend handler pairs: subclasses build both directions."""

    gpu_to_cpu_handler: H
    cpu_to_gpu_handler: H

    @property
    def handlers(self) -> tuple[H, H]:
        """(store handler, load handler)."""
        return self.gpu_to_cpu_handler, self.cpu_to_gpu_handler

    def shutdown(self) -> None:
        for handler in self.handlers:
            handler.shutdown()
