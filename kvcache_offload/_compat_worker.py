"""What ``kvcache_offload.worker`` exported before the renovation (deprecated path)."""

from kvcache_offload._moved import old_submodules
from kvcache_offload.contracts.handler import (
    OffloadingHandler,
    TransferResult,
    TransferSpec,
    TransferType,
)
from kvcache_offload.dataplane.handlers.router import OffloadingWorker

__path__: list[str] = []  # lets kvcache_offload.worker.worker resolve through the finder

__all__ = [
    "OffloadingHandler",
    "OffloadingWorker",
    "TransferResult",
    "TransferSpec",
    "TransferType",
]


__getattr__ = old_submodules("kvcache_offload.worker")
