"""Byte access to offloaded blocks by CPU slot id, whatever holds them.

The async core and the HTTP layer (remote mode: ``PUT/GET /v1/blocks/...``) read and write
whole offloaded blocks as bytes; they should not care whether the bytes live in a private
host buffer, in the per-canonical-tensor CPU tensors of the transfer handlers, or in a row of
the shared ``/dev/shm`` region. :class:`BlockMemory` is that seam.

A block's bytes are always the same concatenation the handlers use, so a block written here
is loadable to the GPU and a block stored from the GPU is readable here:

* :class:`HostBlockMemory`: one private numpy buffer ``(num_blocks, block_nbytes)``.
* :class:`TensorBlockMemory`: a list of 2-D int8 CPU tensors (or numpy arrays) of shape
  ``(num_blocks, page_i)``, possibly with strided rows (shared-region views); a block is
  ``row_0 | row_1 | ...`` of slot ``block_id``.
* :class:`RegionBlockMemory`: the whole row of a :class:`SharedOffloadRegion` (every
  worker's cell of that slot).

This module imports no torch; tensors are reached through ``Tensor.numpy()`` (zero copy).
Out-of-range block ids raise :class:`CapacityError`; data of the wrong length raises
:class:`TransferError`. Reads return fresh ``bytes``; concurrent reads are safe, and
callers serialise writes to one block (the manager never hands a block being written out
for reading).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcache_offload.errors import CapacityError, ConfigError, TransferError

if TYPE_CHECKING:
    from kvcache_offload.dataplane.memory.shared_offload_region import SharedOffloadRegion

__all__ = ["BlockMemory", "HostBlockMemory", "RegionBlockMemory", "TensorBlockMemory"]

Buffer = bytes | bytearray | memoryview


def _as_uint8(data: Buffer) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


class BlockMemory(ABC):
    """``num_blocks`` blocks of ``block_nbytes`` bytes each, addressed by CPU slot id."""

    num_blocks: int
    block_nbytes: int

    @abstractmethod
    def read(self, block_id: int) -> bytes:
        """A copy of the block's bytes."""

    def read_view(self, block_id: int) -> memoryview:
        """A read-only copy of the block's bytes, as a buffer rather than ``bytes``.

        The tier writes take this: numpy copies into a fresh array without holding the GIL
        and with one pass, where ``bytes`` costs a second copy with the GIL held. A writer
        thread holding the GIL for such copies stalled the event loop for milliseconds."""
        return memoryview(self.read(block_id))

    @abstractmethod
    def write(self, block_id: int, data: Buffer) -> None:
        """Overwrite the whole block; ``data`` must be exactly ``block_nbytes`` long."""

    def read_many(self, block_ids: Sequence[int]) -> bytes:
        """The blocks' bytes back to back, in the order given."""
        return b"".join(self.read(b) for b in block_ids)

    def write_many(self, block_ids: Sequence[int], data: Buffer) -> None:
        """Write ``len(block_ids)`` blocks given back to back in ``data``."""
        view = memoryview(data).cast("B")
        n = self.block_nbytes
        if len(view) != n * len(block_ids):
            raise TransferError(
                f"write_many of {len(block_ids)} blocks needs {n * len(block_ids)} bytes, "
                f"got {len(view)}"
            )
        for i, block_id in enumerate(block_ids):
            self.write(block_id, view[i * n : (i + 1) * n])

    def describe(self) -> dict[str, Any]:
        """What this memory is, for logs, ``/v1/info`` and metrics."""
        return {
            "kind": type(self).__name__,
            "num_blocks": self.num_blocks,
            "block_nbytes": self.block_nbytes,
            "total_bytes": self.num_blocks * self.block_nbytes,
        }

    def close(self) -> None:  # noqa: B027
        """Drop references to the underlying memory (idempotent)."""

    # -- helpers for subclasses -----------------------------------------------------------
    def _check_id(self, block_id: int) -> int:
        try:
            idx = int(block_id)
        except (TypeError, ValueError):
            raise CapacityError(f"block id must be an int, got {block_id!r}") from None
        if not 0 <= idx < self.num_blocks:
            raise CapacityError(f"block id {idx} is out of range [0, {self.num_blocks})")
        return idx

    def _check_data(self, data: Buffer) -> np.ndarray:
        arr = _as_uint8(memoryview(data).cast("B"))
        if arr.size != self.block_nbytes:
            raise TransferError(
                f"block data must be exactly {self.block_nbytes} bytes, got {arr.size}"
            )
        return arr

    def __enter__(self) -> BlockMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RowBlockMemory(BlockMemory):
    """Blocks that are whole rows of one ``(num_blocks, block_nbytes)`` uint8 array."""

    _rows: np.ndarray | None

    @property
    def rows(self) -> np.ndarray:
        """The ``(num_blocks, block_nbytes)`` uint8 array itself (no copy)."""
        if self._rows is None:
            raise TransferError(f"{type(self).__name__} is closed")
        return self._rows

    def read(self, block_id: int) -> bytes:
        return self.rows[self._check_id(block_id)].tobytes()

    def read_view(self, block_id: int) -> memoryview:
        out = self.rows[self._check_id(block_id)].copy()
        out.flags.writeable = False
        return out.data

    def write(self, block_id: int, data: Buffer) -> None:
        self.rows[self._check_id(block_id)] = self._check_data(data)

    def read_many(self, block_ids: Sequence[int]) -> bytes:
        ids = [self._check_id(b) for b in block_ids]
        return self.rows[ids].tobytes()


class HostBlockMemory(_RowBlockMemory):
    """A private host buffer; pages are faulted in on first touch (``np.zeros`` = calloc)."""

    def __init__(self, num_blocks: int, block_nbytes: int) -> None:
        if num_blocks < 0 or block_nbytes <= 0:
            raise ConfigError(
                f"HostBlockMemory needs num_blocks >= 0 and block_nbytes > 0, got "
                f"{num_blocks} and {block_nbytes}"
            )
        self.num_blocks = int(num_blocks)
        self.block_nbytes = int(block_nbytes)
        self._rows = np.zeros((self.num_blocks, self.block_nbytes), np.uint8)

    @property
    def array(self) -> np.ndarray:
        """The ``(num_blocks, block_nbytes)`` uint8 buffer itself (no copy)."""
        return self.rows

    def close(self) -> None:
        self._rows = None


def _to_numpy_2d(t: Any) -> np.ndarray:
    """A zero-copy uint8 numpy view of a 2-D int8/uint8 CPU tensor or numpy array."""
    if isinstance(t, np.ndarray):
        arr = t
    else:
        device = getattr(t, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            raise ConfigError(f"TensorBlockMemory needs CPU tensors, got one on {device}")
        arr = t.numpy()
    if arr.ndim != 2 or arr.dtype.itemsize != 1:
        raise ConfigError(
            f"TensorBlockMemory needs 2-D one-byte tensors (num_blocks, page), got shape "
            f"{arr.shape} dtype {arr.dtype}"
        )
    if arr.strides[1] != 1:
        raise ConfigError(f"rows must be contiguous bytes, got strides {arr.strides}")
    return arr.view(np.uint8)


class TensorBlockMemory(BlockMemory):
    """Blocks spread over per-canonical-tensor CPU tensors: block = row_0 | row_1 | ...

    This is exactly the CPU side of the transfer handlers (``handlers.cpu_tensors``), so a
    block written here can be loaded to the GPU and vice versa.
    """

    def __init__(self, tensors: Sequence[Any]) -> None:
        if not tensors:
            raise ConfigError("TensorBlockMemory needs at least one tensor")
        self._arrays: list[np.ndarray] | None = [_to_numpy_2d(t) for t in tensors]
        rows = {a.shape[0] for a in self._arrays}
        if len(rows) != 1:
            raise ConfigError(f"all tensors must have the same number of rows, got {rows}")
        self.num_blocks = rows.pop()
        self._pages = [int(a.shape[1]) for a in self._arrays]
        self._offsets = np.concatenate([[0], np.cumsum(self._pages)]).astype(np.int64)
        self.block_nbytes = int(self._offsets[-1])
        # Keep the tensors alive: the numpy views do not own torch storage.
        self._tensors: list[Any] | None = list(tensors)

    def _spans(self) -> list[tuple[np.ndarray, int, int]]:
        offs = self._offsets
        return [(a, int(offs[i]), int(offs[i + 1])) for i, a in enumerate(self.arrays)]

    @property
    def arrays(self) -> list[np.ndarray]:
        if self._arrays is None:
            raise TransferError("TensorBlockMemory is closed")
        return self._arrays

    def _gather(self, block_id: int) -> np.ndarray:
        idx = self._check_id(block_id)
        out = np.empty(self.block_nbytes, np.uint8)
        for arr, start, stop in self._spans():
            out[start:stop] = arr[idx]
        return out

    def read(self, block_id: int) -> bytes:
        return self._gather(block_id).tobytes()

    def read_view(self, block_id: int) -> memoryview:
        out = self._gather(block_id)
        out.flags.writeable = False
        return out.data

    def read_many(self, block_ids: Sequence[int]) -> bytes:
        ids = np.asarray([self._check_id(b) for b in block_ids], dtype=np.int64)
        out = np.empty((len(ids), self.block_nbytes), np.uint8)
        for arr, start, stop in self._spans():
            out[:, start:stop] = arr[ids]
        return out.tobytes()

    def write(self, block_id: int, data: Buffer) -> None:
        idx = self._check_id(block_id)
        src = self._check_data(data)
        for arr, start, stop in self._spans():
            arr[idx] = src[start:stop]

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["page_sizes"] = list(self._pages)
        return info

    def close(self) -> None:
        self._arrays = None
        self._tensors = None


class RegionBlockMemory(_RowBlockMemory):
    """Whole rows of a shared region: every worker's cell of slot ``block_id``.

    With ``owns_region`` the region is cleaned up (unmapped, its file unlinked if still
    there) when this memory is closed.
    """

    def __init__(self, region: SharedOffloadRegion, *, owns_region: bool = False) -> None:
        self._region: SharedOffloadRegion | None = region
        self._owns_region = owns_region
        self._rows = region.rows_array()
        self.num_blocks = int(self._rows.shape[0])
        self.block_nbytes = int(self._rows.shape[1])

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        if self._region is not None:
            info.update(self._region.describe())
        return info

    def close(self) -> None:
        # Drop our numpy view so the region's mmap can close without BufferError.
        self._rows = None
        region, self._region = self._region, None
        if region is not None and self._owns_region:
            region.cleanup()
