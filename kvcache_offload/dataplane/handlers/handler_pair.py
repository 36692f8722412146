"""The store and load handlers of one set of CPU tensors, owned and shut down together."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from kvcache_offload.contracts.handler import OffloadingHandler

__all__ = ["HandlerPair"]

H = TypeVar("H", bound=OffloadingHandler)


class HandlerPair(Generic[H]):
    """Base of the CUDA and CPU-backend handler pairs: subclasses build both directions."""

    gpu_to_cpu_handler: H
    cpu_to_gpu_handler: H
    gpu_tensors: list[Any]
    cpu_tensors: list[Any]

    @property
    def handlers(self) -> tuple[H, H]:
        """(store handler, load handler)."""
        return self.gpu_to_cpu_handler, self.cpu_to_gpu_handler

    def shutdown(self) -> None:
        """Stop both handlers, then let go of the CPU tier.

        The tier (a pinned buffer of the whole CPU capacity on CUDA) is released here rather
        than whenever the garbage collector breaks the engine's reference cycles: the memory
        comes back when the engine closes, and unpinning gigabytes (slow, and synchronizing
        the device) does not land in the middle of whatever the process runs at the moment a
        later collection happens to free it."""
        for handler in self.handlers:
            handler.shutdown()
        self.cpu_tensors = []
        self.gpu_tensors = []
