"""What ``kvcache_offload.worker`` exported before the renovation (deprecated path)."""

import importlib
from typing import Any

from kvcache_offload._moved import new_name
from kvcache_offload.contracts.handler import (
    OffloadingHandler,
    TransferResult,
    TransferSpec,
    TransferType,
)
from kvcache_offload.dataplane.handlers.router import OffloadingWorker

__path__: list[str] = []  # lets kvcache_offload.contracts.handler resolve through the finder

__all__ = [
    "OffloadingHandler",
    "OffloadingWorker",
    "TransferResult",
    "TransferSpec",
    "TransferType",
]


def __getattr__(name: str) -> Any:
    """Old submodules (``from kvcache_offload.worker import submodule``) through the alias table."""
    new = new_name(f"kvcache_offload.worker.{name}")
    if new is None or new == __name__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return importlib.import_module(new)
    except ModuleNotFoundError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
