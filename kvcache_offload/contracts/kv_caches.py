"""The canonical description of a GPU KV cache: unique int8 page views plus per-group refs.

Importing this module never imports torch: the tensor type is named for type checkers only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["CanonicalKVCacheRef", "CanonicalKVCacheTensor", "CanonicalKVCaches"]


@dataclass
class CanonicalKVCacheTensor:
    """An int8 ``(num_blocks, page_size_bytes)`` view of one unique GPU KV tensor."""

    tensor: torch.Tensor
    page_size_bytes: int


@dataclass(frozen=True)
class CanonicalKVCacheRef:
    """A layer's reference to a canonical tensor plus the un-padded bytes to copy per block."""

    tensor_idx: int
    page_size_bytes: int


@dataclass
class CanonicalKVCaches:
    """Unique canonical tensors and, per KV-cache group, the refs of that group's layers."""

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]] = field(default_factory=list)
