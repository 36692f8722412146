"""Shared storage for the queue-based policies, with optional prefix-order insertion.

The manager inserts one store's keys in prefix order (head first). In a FIFO that makes the
head the oldest block, so it is evicted first and takes the value of every deeper block of
the same prefix with it (the scheduler stops its lookup at the first miss). With
``prefix_order`` on, the keys inserted back to back are held as a batch and enqueued in
reverse when the next non-insert call arrives, so the tail of a prefix is evicted first.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Collection

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies.base import (
    BlockStatus,
    CachePolicy,
)

__all__ = ["PlannedQueuePolicy", "QueuePolicy"]


class QueuePolicy(CachePolicy):
    """Keeps ``key -> BlockStatus`` in one dict; subclasses own the queues.

    Subclasses implement ``_enqueue`` (place a new block), ``_dequeue`` (drop a removed
    block from their queues) and ``_clear_queues``, and call ``_flush_batch`` at the start of
    every operation that reads or reorders their queues.
    """

    prefix_order: bool = False

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._blocks: dict[OffloadKey, BlockStatus] = {}
        self._batch: list[OffloadKey] = []

    @abstractmethod
    def _enqueue(self, key: OffloadKey, block: BlockStatus) -> None:
        """Place a newly stored block in the policy's queues."""

    @abstractmethod
    def _dequeue(self, key: OffloadKey) -> None:
        """Take a removed block (its store failed) out of the policy's queues."""

    @abstractmethod
    def _clear_queues(self) -> None:
        """Empty the policy's queues and reset what it learned."""

    def remove(self, key: OffloadKey) -> None:
        self._flush_batch()
        del self._blocks[key]
        self._dequeue(key)

    def clear(self) -> None:
        self._blocks.clear()
        self._batch.clear()
        self._clear_queues()

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self._blocks[key] = block
        if self.prefix_order:
            self._batch.append(key)
        else:
            self._enqueue(key, block)

    def _flush_batch(self) -> None:
        batch = self._batch
        if batch:
            blocks = self._blocks
            for key in reversed(batch):
                block = blocks.get(key)
                if block is not None:
                    self._enqueue(key, block)
            batch.clear()

    def _is_candidate(self, key: OffloadKey, protected: Collection[OffloadKey]) -> bool:
        return self._blocks[key].ref_cnt == 0 and key not in protected

    def __len__(self) -> int:
        return len(self._blocks)


class PlannedQueuePolicy(QueuePolicy):
    """A queue policy that first plans its victims, changing nothing, then applies the plan:
    a store that cannot get ``n`` victims leaves the queues exactly as they were."""

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        self._flush_batch()
        steps = self._plan(n, protected)
        return None if steps is None else self._apply(steps)

    @abstractmethod
    def _plan(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[int, OffloadKey]] | None:
        """The moves that yield ``n`` victims, or None when there are not enough."""

    @abstractmethod
    def _apply(self, steps: list[tuple[int, OffloadKey]]) -> list[tuple[OffloadKey, BlockStatus]]:
        """Carry out planned moves; the victims in eviction order."""
