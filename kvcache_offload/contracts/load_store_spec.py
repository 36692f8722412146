"""Load/store specs: where a job's blocks are, per medium (vLLM's ``LoadStoreSpec``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Self

import numpy as np

from kvcache_offload.errors import ConfigError

__all__ = [
    "BlockIDsLoadStoreSpec",
    "CPULoadStoreSpec",
    "GPULoadStoreSpec",
    "LoadStoreSpec",
    "int64_block_ids",
]

_INT64 = np.dtype(np.int64)


def int64_block_ids(block_ids: object, what: str = "block ids") -> np.ndarray:
    """``block_ids`` as an int64 array (its shape kept). Anything but integers (floats,
    booleans, strings, a tensor numpy cannot read) is a :class:`ConfigError`: a cast to
    int64 would truncate ``0.5`` to block 0 without a word. For a list of ints the inferred
    conversion costs what the cast does."""
    try:
        ids = np.asarray(block_ids)
    except (TypeError, ValueError, RuntimeError) as exc:  # a device tensor, a ragged list
        raise ConfigError(
            f"{what} must be integers in host memory (a list, a numpy array or a CPU tensor): {exc}"
        ) from exc
    if ids.dtype is not _INT64:
        if ids.dtype.kind not in "iu":
            if ids.size == 0:  # an empty list infers float64
                return np.empty(ids.shape, dtype=np.int64)
            raise ConfigError(f"{what} must be integers, got {ids.dtype} values")
        ids = ids.astype(np.int64)  # range checks come later: an overflow reads as negative
    return ids


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
        self._block_ids: np.ndarray | None = int64_block_ids(block_ids).reshape(-1)

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
            array = np.asarray(self._owned_ids, dtype=np.int64)
            if array.ndim != 1:  # a list of ints is 1-D already: no reshape call per job
                array = array.reshape(-1)
            self._block_ids = array
            self._owned_ids = None
        return array

    @block_ids.setter
    def block_ids(self, value: Sequence[int] | np.ndarray) -> None:
        self._owned_ids = None
        self._block_ids = int64_block_ids(value).reshape(-1)

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

    @classmethod
    def checked_parts(
        cls, block_ids: np.ndarray, group_sizes: tuple[int, ...], block_indices: tuple[int, ...]
    ) -> GPULoadStoreSpec:
        """A spec from parts the caller already checked (int64 ids, int tuples that agree).

        The engine builds one per job from ids it validated itself; skipping the
        re-validation is a measurable share of a 1-block job's host time."""
        spec = cls.__new__(cls)
        spec._owned_ids = None
        spec._block_ids = block_ids
        spec.group_sizes = group_sizes
        spec.block_indices = block_indices
        return spec

    @staticmethod
    def medium() -> str:
        return "GPU"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """CPU slot indices, one per offloaded block."""

    @staticmethod
    def medium() -> str:
        return "CPU"
