"""Contracts shared by the control plane and the data plane.

Keys, request context, load/store specs, events, the manager ABC, the canonical KV-cache
description and the spec ABC. Importing this module never imports torch: the canonical
tensor types only name ``torch.Tensor`` for type checkers.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NewType, Self

import numpy as np

from kvcache_offload.errors import ConfigError, InvalidKeyError

if TYPE_CHECKING:
    import torch

    from kvcache_offload.config import KVCacheLayout, OffloadConfig
    from kvcache_offload.worker.worker import OffloadingHandler

__all__ = [
    "BlockIDsLoadStoreSpec",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "GPULoadStoreSpec",
    "LoadStoreSpec",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "OffloadingSpec",
    "PrepareStoreOutput",
    "ReqContext",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]

logger = logging.getLogger(__name__)

OffloadKey = NewType("OffloadKey", bytes)
"""Block hash bytes followed by the KV-cache group index as 4 big-endian bytes.

Raw bytes (not tuples) keep hashing cheap and put no extra objects on the GC's plate.
"""

_GROUP_IDX_BYTES = 4
_MAX_GROUP_IDX = 2**32 - 1


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Join a block hash and its KV-cache group index into one key."""
    if not isinstance(block_hash, bytes | bytearray | memoryview):
        raise InvalidKeyError(f"block hash must be bytes, got {type(block_hash).__name__}")
    if not isinstance(group_idx, int) or not 0 <= group_idx <= _MAX_GROUP_IDX:
        raise InvalidKeyError(f"group index must be an int in [0, 2**32), got {group_idx!r}")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(_GROUP_IDX_BYTES, "big"))


def validate_offload_key(key: object) -> OffloadKey:
    """Return ``key`` if it is a well-formed offload key, else raise :class:`InvalidKeyError`."""
    if not isinstance(key, bytes):
        raise InvalidKeyError(f"offload key must be bytes, got {type(key).__name__}")
    if len(key) <= _GROUP_IDX_BYTES:
        raise InvalidKeyError(
            f"offload key must hold a block hash plus a 4-byte group index "
            f"(> {_GROUP_IDX_BYTES} bytes), got {len(key)} bytes"
        )
    return OffloadKey(key)


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block-hash part of a key (all but the last 4 bytes)."""
    return bytes(validate_offload_key(key)[:-_GROUP_IDX_BYTES])


def get_offload_group_idx(key: OffloadKey) -> int:
    """The group-index part of a key (last 4 bytes, big-endian, unsigned)."""
    return int.from_bytes(validate_offload_key(key)[-_GROUP_IDX_BYTES:], "big")


@dataclass
class ReqContext:
    """Per-request information passed to every manager call."""

    req_id: str = ""
    kv_transfer_params: dict[str, Any] | None = None


class LoadStoreSpec(ABC):
    """An opaque address of data on one medium; workers route (src, dst) pairs by medium."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """Name of the medium this spec addresses ("GPU", "CPU", ...)."""


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """A spec addressing blocks by integer id; ids live in an int64 numpy array."""

    def __init__(self, block_ids: Sequence[int] | np.ndarray) -> None:
        self._owned_ids: list[int] | None = None
        self._block_ids: np.ndarray | None = np.asarray(block_ids, dtype=np.int64).reshape(-1)

    @classmethod
    def from_owned_list(cls, block_ids: list[int]) -> Self:
        """Wrap a list nobody will modify again; the array is built on first access.

        The scheduler-side manager returns a spec from every prepare call, many of which never
        reach a worker (replays, lookups-only clients): converting eagerly cost ~1 us each.
        """
        spec = cls.__new__(cls)
        spec._owned_ids = block_ids
        spec._block_ids = None
        return spec

    @property
    def block_ids(self) -> np.ndarray:
        array = self._block_ids
        if array is None:
            array = self._block_ids = np.asarray(self._owned_ids, dtype=np.int64).reshape(-1)
            self._owned_ids = None
        return array

    @block_ids.setter
    def block_ids(self, value: Sequence[int] | np.ndarray) -> None:
        self._owned_ids = None
        self._block_ids = np.asarray(value, dtype=np.int64).reshape(-1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids!r})"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU block ids, concatenated group by group.

    ``block_indices[g]`` is the logical index (within the request, in GPU blocks) of group g's
    first block: the worker needs it to skip the leading sub-blocks of a partially covered
    first CPU block.
    """

    def __init__(
        self,
        block_ids: Sequence[int] | np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
    ) -> None:
        super().__init__(block_ids)
        self.group_sizes: tuple[int, ...] = tuple(int(s) for s in group_sizes)
        self.block_indices: tuple[int, ...] = tuple(int(i) for i in block_indices)
        if sum(self.group_sizes) != len(self.block_ids):
            raise ConfigError(
                f"group_sizes {self.group_sizes} sum to {sum(self.group_sizes)}, "
                f"expected the number of block ids ({len(self.block_ids)})"
            )
        if len(self.block_indices) != len(self.group_sizes):
            raise ConfigError(
                f"block_indices has {len(self.block_indices)} entries, expected one per "
                f"group ({len(self.group_sizes)})"
            )
        if any(s < 0 for s in self.group_sizes) or any(i < 0 for i in self.block_indices):
            raise ConfigError("group_sizes and block_indices must be non-negative")

    @staticmethod
    def medium() -> str:
        return "GPU"


@dataclass
class PrepareStoreOutput:
    """Which keys to store, where (spec co-indexed with keys) and what was evicted for them."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass
class OffloadingEvent:
    """Keys that became loadable (``removed=False``) or were evicted (``removed=True``)."""

    keys: list[OffloadKey]
    medium: str
    removed: bool


class OffloadingManager(ABC):
    """Scheduler-side bookkeeping of offloaded blocks; never touches memory.

    ``lookup`` answers True (ready), False (absent) or None (present but being written:
    retry later).
    """

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """Whether ``key`` is offloaded and ready (True), absent (False) or pending (None)."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin ready blocks for reading; the spec's ids are co-indexed with ``keys``."""

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:  # noqa: B027
        """Mark blocks recently used; the first key ends up most recently used."""

    def complete_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:  # noqa: B027
        """Unpin blocks pinned by :meth:`prepare_load`."""

    @abstractmethod
    def prepare_store(
        self, keys: Sequence[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Allocate slots for the keys not yet offloaded, evicting if needed; None if it can't."""

    def complete_store(  # noqa: B027
        self, keys: Sequence[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Make stored blocks loadable, or drop them when the transfer failed."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Drain the events emitted since the last call."""
        return ()

    def reset_cache(self) -> None:  # noqa: B027
        """Drop every offloaded block (callers must have drained in-flight transfers)."""

    def shutdown(self) -> None:  # noqa: B027
        """Release resources."""


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
