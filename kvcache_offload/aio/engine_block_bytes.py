"""Block bytes for remote clients: write and read offloaded blocks as plain bytes.

A client that has no GPU in this process (HTTP ``/v1/blocks``, a tier promoting a key) brings
or takes the bytes of whole offloaded blocks. The copies run in worker threads against the
spec's block memory and are counted in :class:`~kvcache_offload.aio.slot_fence.BlockCopies`,
so a reset never hands out a slot that a copy still touches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio

from kvcache_offload.aio.engine_core import (
    LOAD_DIRECTION,
    STORE_DIRECTION,
    EnginePart,
    block_ids_of,
)
from kvcache_offload.aio.types import EventType, StoreResult
from kvcache_offload.contracts.capabilities import HasBlockMemory
from kvcache_offload.contracts.manager import ReqContext
from kvcache_offload.errors import ConfigError, OffloadError, TransferError

if TYPE_CHECKING:
    from kvcache_offload.contracts.offload_key import OffloadKey
    from kvcache_offload.dataplane.memory.block_memory import BlockMemory

__all__ = ["BlockBytes"]


class BlockBytes(EnginePart):
    """``write_blocks``, ``read_block``, ``block_nbytes`` and ``region_info``."""

    def _memory(self) -> BlockMemory:
        c = self._core
        if c._block_memory is None:
            if not isinstance(c.spec, HasBlockMemory):
                raise ConfigError(f"{type(c.spec).__name__} has no block memory")
            c._block_memory = c.spec.get_block_memory()
        return c._block_memory

    async def get_block_memory(self) -> BlockMemory:
        """The spec's block memory (the spec creates it once, also for callers at once)."""
        c = self._core
        if c._block_memory is None:
            c._block_memory = await anyio.to_thread.run_sync(self._memory)
        return c._block_memory

    @property
    def block_nbytes(self) -> int:
        """Bytes of one offloaded block: the page size of ``write_blocks``/``read_block``."""
        return self._memory().block_nbytes

    def region_info(self) -> dict[str, Any] | None:
        """The shared region's description when the blocks live in one, else None."""
        c = self._core
        if not c.config.shared_region:
            return None
        return self._memory().describe()

    async def write_blocks(
        self, keys: Sequence[OffloadKey], data: Sequence[bytes | bytearray | memoryview]
    ) -> StoreResult:
        """Store blocks whose bytes the caller brings (remote mode); ``data[i]`` is ``keys[i]``."""
        c = self._core
        keys = list(keys)
        if len(data) != len(keys):
            raise ConfigError(f"got {len(data)} data blocks for {len(keys)} keys")
        memory = await self.get_block_memory()
        size = memory.block_nbytes
        for key, blob in zip(keys, data, strict=True):
            if len(memoryview(blob).cast("B")) != size:
                raise ConfigError(
                    f"block data for key {key.hex()} must be {size} bytes, got {len(blob)}"
                )
        ctx = ReqContext()
        if c._tiers is not None:
            await c._tier_room(keys)
        out = c._prepare_store(keys, ctx)
        stored = out.keys_to_store
        if not stored:
            return StoreResult([], out.evicted_keys)
        by_key: dict[OffloadKey, bytes | bytearray | memoryview] = {}
        for key, blob in zip(keys, data, strict=True):
            by_key.setdefault(key, blob)
        writes = list(zip(block_ids_of(out.store_spec), (by_key[k] for k in stored), strict=True))

        def copy_in() -> float:
            start = time.perf_counter()
            for block_id, blob in writes:
                memory.write(block_id, blob)
            return time.perf_counter() - start

        success = False
        # Counted from before the first await: a reset waits for this copy (slot_fence).
        with c._copies.copying():
            try:
                seconds = await anyio.to_thread.run_sync(copy_in)
                success = True
            except OffloadError as exc:
                raise TransferError(f"writing {len(stored)} blocks failed: {exc}") from exc
            finally:
                c._finish_store(stored, ctx, success, "" if success else "block write failed")
        c._record_copy(STORE_DIRECTION, size * len(stored), seconds)
        return StoreResult(stored, out.evicted_keys, size * len(stored), seconds)

    async def read_block(self, key: OffloadKey) -> bytes:
        """The bytes of one ready block; :class:`BlockStateError` if it is not ready."""
        c = self._core
        memory = await self.get_block_memory()
        ctx = ReqContext()
        if c._tiers is not None:
            await c._tiers.promote([key])
        (block_id,) = c._prepare_load([key], ctx)
        start = time.perf_counter()
        with c._copies.copying():
            try:
                data = await anyio.to_thread.run_sync(memory.read, block_id)
            finally:
                c.manager.complete_load([key], ctx)
        c._record_copy(LOAD_DIRECTION, len(data), time.perf_counter() - start)
        c._totals.load_blocks_completed += 1
        c._hub.publish(EventType.LOAD_COMPLETED, [key], detail={"req_id": "", "remote": True})
        return data
