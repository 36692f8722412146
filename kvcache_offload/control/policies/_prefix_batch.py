"""Shared storage for the queue-based policies, with optional prefix-order insertion.

The manager inserts one store's keys in prefix order (head first). In a FIFO that makes the
head the oldest block, so it is evicted first and takes the value of every deeper block of
the same prefix with it (the scheduler stops its lookup at the first miss). With
``prefix_order`` on, one store's keys are held as a batch and enqueued in reverse when the
next call arrives (another store included), so the tail of a prefix is evicted first.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._ghosts import GhostList, StampedGhostList
from kvcache_offload.control.policies._stamp_queue import StampQueue
from kvcache_offload.control.policies.base import (
    Blocks,
    BlockStatus,
    CachePolicy,
    Keys,
    Protected,
    Victims,
    append_victims,
    victims_from,
)

__all__ = ["Queue", "QueuePolicy"]

Queue = dict[OffloadKey, Any] | GhostList | StampedGhostList | StampQueue
"""What a queue policy keeps keys in: ordered dicts, stamp queues (queues, marks) and
ghost lists."""


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class QueuePolicy(CachePolicy):
    """Keeps ``key -> BlockStatus`` in one dict; subclasses own the queues.

    Subclasses name their queues in ``queue_attributes`` (every container a key may sit
    in: queues, ghost lists, per-key marks), implement ``_enqueue`` (place a new block) and
    ``_select`` or ``_select_blocks`` (the victims, as pairs or appended to two lists: the
    manager's ``evict_blocks`` takes the lists), and call ``_flush_batch`` at the start of
    every other operation that reads or reorders their queues. Removal, clearing, the
    ``n <= 0`` case of eviction and ``debug_state`` (the size of each named queue) are done
    here once.
    """

    prefix_order: ClassVar[bool] = False

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._blocks: dict[OffloadKey, BlockStatus] = {}
        self._batch: list[OffloadKey] = []
        # The block of each batched key: the flush then probes no table (every call that
        # could drop a key, ``remove`` and ``evict``, flushes first, so they stay current).
        self._batch_blocks: list[BlockStatus] = []
        # Read once: compiled, a class attribute costs a lookup on every insert.
        self._prefix_order = self.prefix_order
        # Whether ``insert_blocks`` may do the inserts itself: not when a subclass changed how
        # a block is inserted (its ``insert`` or ``insert_many`` must still see every one).
        cls = type(self)
        self._plain_insert = (
            cls.insert is QueuePolicy.insert and cls.insert_many is QueuePolicy.insert_many
        )
        # Whether ``insert_many`` may batch the pairs itself (a subclass's ``insert`` must
        # still see every one).
        self._batch_many = self._prefix_order and cls.insert is QueuePolicy.insert
        # Likewise for eviction: a subclass overriding ``evict`` or one of the two selection
        # hooks over a class that implements the other is obeyed through ``evict``.
        self._plain_evict = cls.evict is QueuePolicy.evict and (
            cls._select is QueuePolicy._select or cls._select_blocks is QueuePolicy._select_blocks
        )

    queue_attributes: ClassVar[tuple[str, ...]] = ()
    """The attributes holding every container a key can be in (queues, ghost lists, marks)."""

    def _queues(self) -> dict[str, Queue]:
        """The containers of ``queue_attributes``, named as ``debug_state`` reports them."""
        return {name.lstrip("_"): getattr(self, name) for name in self.queue_attributes}

    @abstractmethod
    def _enqueue(self, key: OffloadKey, block: BlockStatus) -> None:
        """Place a newly stored block in the policy's queues."""

    def _select(self, n: int, protected: Protected) -> Victims | None:
        """``evict`` for ``n >= 1`` with the batch flushed. A subclass implements this or
        :meth:`_select_blocks` (each defaults to the other)."""
        return victims_from(self._select_blocks, n, protected)

    def _select_blocks(self, n: int, protected: Protected, keys: Keys, blocks: Blocks) -> bool:
        """``evict_blocks`` for ``n >= 1`` with the batch flushed (see :meth:`_select`)."""
        return append_victims(self._select(n, protected), keys, blocks)

    def _reset_learning(self) -> None:
        """Forget what the policy learned beyond its queues (on ``clear``); none by default."""

    def _learned_state(self) -> dict[str, object]:
        """What ``debug_state`` shows beyond the queue sizes (targets, weights)."""
        return {}

    def remove(self, key: OffloadKey) -> None:
        # A store failed: the key is live, so it sits in none of the ghost lists.
        self._flush_batch()
        del self._blocks[key]
        for queue in self._queues().values():
            queue.pop(key, None)

    def clear(self) -> None:
        self._blocks.clear()
        self._batch.clear()
        self._batch_blocks.clear()
        for queue in self._queues().values():
            queue.clear()
        self._reset_learning()

    def evict(self, n: int, protected: Protected) -> Victims | None:
        if n <= 0:
            return []
        self._flush_batch()
        return self._select(n, protected)

    def evict_blocks(self, n: int, protected: Protected, keys: Keys, blocks: Blocks) -> bool:
        if not self._plain_evict:
            return super().evict_blocks(n, protected, keys, blocks)
        if n <= 0:
            return True
        self._flush_batch()
        return self._select_blocks(n, protected, keys, blocks)

    def debug_state(self) -> dict[str, object]:
        self._flush_batch()
        state: dict[str, object] = {"size": len(self)}
        for name, queue in self._queues().items():
            state[name] = len(queue)
        state.update(self._learned_state())
        return state

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    def block_table(self) -> dict[OffloadKey, BlockStatus]:
        # Holds exactly the stored blocks and is only ever emptied in place: the manager
        # uses it as its lookup table instead of keeping a second copy.
        return self._blocks

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self._blocks[key] = block
        if self._prefix_order:
            self._batch.append(key)
            self._batch_blocks.append(block)
        else:
            self._enqueue(key, block)

    def insert_many(self, pairs: Sequence[tuple[OffloadKey, BlockStatus]]) -> None:
        # One store per batch (see ``insert_blocks``).
        if self._batch:
            self._flush_batch()
        if self._batch_many:  # ``insert`` of each pair, in one dict update
            self._blocks.update(pairs)
            batch, batch_blocks = self._batch, self._batch_blocks
            for key, block in pairs:
                batch.append(key)
                batch_blocks.append(block)
            return
        for key, block in pairs:
            self.insert(key, block)

    def insert_blocks(self, keys: list[OffloadKey], blocks: list[BlockStatus]) -> None:
        if not self._plain_insert:
            super().insert_blocks(keys, blocks)
            return
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys for {len(blocks)} blocks")
        table = self._blocks
        if self._prefix_order:
            if self._batch:
                # Stores that arrive back to back (no other call between them, as an engine
                # under stores-only traffic issues them) stay separate batches: merged, the
                # reversal would put the later store's blocks ahead of the earlier one's
                # in the queue, as if they were older, and a policy that learns from each
                # store's last block (``alru``'s tails) would see only the last store's.
                self._flush_batch()
            for index in range(len(keys)):
                table[keys[index]] = blocks[index]
            self._batch.extend(keys)
            self._batch_blocks.extend(blocks)
        else:
            for index in range(len(keys)):
                key = keys[index]
                block = blocks[index]
                table[key] = block
                self._enqueue(key, block)

    def _flush_batch(self) -> None:
        batch = self._batch
        if batch:
            batch_blocks = self._batch_blocks
            for index in range(len(batch) - 1, -1, -1):
                self._enqueue(batch[index], batch_blocks[index])
            batch.clear()
            batch_blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)
