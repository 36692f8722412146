"""Worker side: job/result types, the handler ABC and the handler router."""

from kvcache_offload.worker.worker import (
    OffloadingHandler,
    OffloadingWorker,
    TransferResult,
    TransferSpec,
    TransferType,
)

__all__ = [
    "OffloadingHandler",
    "OffloadingWorker",
    "TransferResult",
    "TransferSpec",
    "TransferType",
]
