"""LRU-2 for prefix caches: blocks never used since their store leave first.

O'Neil, O'Neil and Weikum (SIGMOD'93) evict the block whose second-last access is oldest,
and blocks seen only once before any of them. In a prefix cache most stored blocks are never
read again (76 % of the conversation trace's blocks), while a block read once is read again
far more often than an average block (42 % against 24 %): LRU-2 keeps those through the flood
of one-off prefixes, which LRU cannot. It loses where the cache already holds most of the
reuse, since a block gets no second chance before its first use; the adaptive policy
(:mod:`.adaptive`) picks it only where it pays.

A store is the first access; ``touch`` of a ready block is a use (a store just prepared is
not). A store's keys enter the probation queue tail first (a prefix loses its tail before its
head), and a key stored again soon after eviction (a ghost, ``history`` x capacity remembered
with their last access time) starts with that access as its history. Used blocks sit in a
heap keyed by their second-last access, one entry per block, refreshed lazily: a use only
updates the block's stamps (its ``mark`` and ``second_mark``: no per-key dict), and an entry
that reaches the top with an outdated second-last access is pushed again with the current
one (it can only have grown), so the first up-to-date entry on top is the true oldest. A hot
block costs nothing in the heap between evictions.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from typing import Any, ClassVar, final

from mypy_extensions import i64, mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._ghosts import StampedGhostList
from kvcache_offload.control.policies._mark_queue import MarkQueue
from kvcache_offload.control.policies._prefix_batch import QueuePolicy
from kvcache_offload.control.policies.base import BlockStatus

__all__ = ["LRU2CachePolicy"]


@final
class _Heap:
    """The used blocks, oldest second-last access first: a binary heap of the stamps each key
    was pushed with (every stamp is one access of one key, so none repeats) and the key of
    each stamp. Plain ints compare far cheaper than tuples.

    Shown (``repr``) as its sorted (stamp, key) pairs: a failed eviction pops and pushes back
    entries, which can reorder the list but never changes what it holds.

    The heap and the dict hold each stamp as one Python int object (typed ``Any``): an ``int``
    compiled is unboxed, and every use of it as a list item or dict key would box it again,
    allocating a new int object per push and two per pop. The sifts are this module's own
    (compiled, native ``i64``): the same order as ``heapq``, without its generic comparisons.
    """

    __slots__ = ("_stamps", "keys", "stamp")

    def __init__(self) -> None:
        self._stamps: list[Any] = []  # int objects
        self.keys: dict[Any, OffloadKey] = {}  # int object -> key
        self.stamp = 0

    def push(self, stamp: int, key: OffloadKey) -> None:
        boxed: Any = stamp  # boxed once for both
        heap = self._stamps
        heap.append(boxed)
        _sift_toward_root(heap, 0, len(heap) - 1)
        self.keys[boxed] = key

    def pop(self) -> OffloadKey:
        """Remove the oldest entry and return its key; :attr:`stamp` is then its stamp."""
        heap = self._stamps
        last = heap.pop()
        if heap:
            boxed = heap[0]
            heap[0] = last
            _sift_to_leaf(heap, 0)
        else:
            boxed = last
        self.stamp = boxed
        keys = self.keys
        key = keys[boxed]  # get and del: compiled, ``dict.pop`` is a generic method call
        del keys[boxed]
        return key

    def rebuild(self, keys: dict[int, OffloadKey]) -> None:
        stamps: list[Any] = list(keys)
        heapq.heapify(stamps)
        self._stamps = stamps
        self.keys = dict(keys)

    def clear(self) -> None:
        self._stamps.clear()
        self.keys.clear()

    def __len__(self) -> int:
        return len(self._stamps)

    def __repr__(self) -> str:
        return repr(sorted(self.keys.items()))


def _sift_toward_root(heap: list[Any], start: i64, pos: i64) -> None:
    """``heapq._siftdown``: move ``heap[pos]`` up to its place (not above ``start``).

    The heap's own sifts, compiled with native 64-bit ints: ``heapq`` compares two int
    objects through the generic rich comparison at every level, here each is unboxed (no
    allocation) and compared natively, and the entries move as the objects they are.
    """
    item = heap[pos]
    value: i64 = item
    while pos > start:
        parent_pos = (pos - 1) >> 1
        parent = heap[parent_pos]
        parent_value: i64 = parent
        if value < parent_value:
            heap[pos] = parent
            pos = parent_pos
            continue
        break
    heap[pos] = item


def _sift_to_leaf(heap: list[Any], pos: i64) -> None:
    """``heapq._siftup``: move ``heap[pos]`` down to a leaf along the smaller children, then
    up to its place (fewer comparisons than stopping early, as in ``heapq``)."""
    end: i64 = len(heap)
    start = pos
    item = heap[pos]
    child = 2 * pos + 1
    while child < end:
        right = child + 1
        if right < end:
            left_value: i64 = heap[child]
            right_value: i64 = heap[right]
            if not left_value < right_value:
                child = right
        heap[pos] = heap[child]
        pos = child
        child = 2 * pos + 1
    heap[pos] = item
    _sift_toward_root(heap, start, pos)


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class LRU2CachePolicy(QueuePolicy):
    """Probation (used once) first, then used blocks by oldest second-last access."""

    name = "lru2"
    queue_attributes = ("_ghost",)  # and the probation queue and main, which live in marks
    prefix_order = True
    history: ClassVar[float] = 8.0
    """Evicted keys remembered (with their last access), as a multiple of the capacity."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        # Each block's ``mark`` holds its last access: > 0, the time of its only access (its
        # store) while on probation; -1 - its last access once used (in main), and then its
        # ``second_mark`` its second-last access. No per-key dict of stamps.
        # The blocks on probation, oldest first (their marks are their stamps, and their
        # ``second_mark`` the queue's token of their entry).
        self._probation = MarkQueue()
        # The used blocks (main), by second-last access: one heap entry per used block.
        self._used = 0
        self._heap = _Heap()
        # Evicted key -> its last access, oldest first, ``history`` x capacity of them.
        self._ghost = StampedGhostList(max(1, int(self.history * cache_capacity)))
        self._now = 0
        # Whether the flush may enqueue inline: not when a subclass changed ``_enqueue``.
        self._plain_enqueue = type(self)._enqueue is LRU2CachePolicy._enqueue

    def adopt_table(self, table: dict[OffloadKey, BlockStatus]) -> None:
        """Keep the blocks in ``table`` (holding exactly this policy's blocks) from now on:
        the adaptive policy's block table, so that a store or an eviction updates one dict,
        not two."""
        self._blocks = table

    def _reset_learning(self) -> None:
        self._probation.clear()
        self._heap.clear()
        self._used = 0
        self._now = 0

    def _learned_state(self) -> dict[str, object]:
        return {"main": self._used, "probation": len(self._probation)}

    def _enqueue(self, key: OffloadKey, block: BlockStatus) -> None:
        now = self._now + 1
        self._now = now
        last = self._ghost.recall_stamp(key)
        if last < 0:
            self._probation.push(key, block, now)
        else:
            self._used += 1
            block.second_mark = last
            block.mark = -1 - now
            self._heap.push(last, key)

    def _flush_batch(self) -> None:
        batch = self._batch
        if not batch:
            return
        if not self._plain_enqueue:
            super()._flush_batch()
            return
        batch_blocks = self._batch_blocks
        ghost, probation, heap = self._ghost, self._probation, self._heap
        used = self._used
        now = self._now  # in a local, stored back at the end
        for index in range(len(batch) - 1, -1, -1):
            # :meth:`_enqueue`, inline: a method call and the clock's attribute per key.
            key = batch[index]
            block = batch_blocks[index]
            now += 1
            last = ghost.recall_stamp(key)
            if last < 0:
                probation.push(key, block, now)
            else:
                used += 1
                block.second_mark = last
                block.mark = -1 - now
                heap.push(last, key)
        self._used = used
        self._now = now
        batch.clear()
        batch_blocks.clear()

    def remove(self, key: OffloadKey) -> None:
        self._flush_batch()  # first: a batched key may be enqueued (into main) by the flush
        block = self._blocks[key]
        if MarkQueue.holds(block):
            self._probation.take(block)
        in_main = block.mark < 0
        super().remove(key)
        if in_main:  # a failed store of a ghost key: its heap entry goes too (rare)
            self._used -= 1
            self._heap.rebuild({b.second_mark: k for k, b in self._blocks.items() if b.mark < 0})

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._flush_batch()
        blocks, probation, heap = self._blocks, self._probation, self._heap
        used = 0  # blocks that left probation
        now = self._now  # in a local, stored back at the end
        # A list (the manager's argument) is walked by index: ``reversed`` of a sequence
        # costs a builtins lookup and call per touch and a generic iterator step per key.
        key_list = keys if isinstance(keys, list) else list(keys)
        for position in range(len(key_list) - 1, -1, -1):
            key = key_list[position]
            block = blocks.get(key)
            if block is None or block.ref_cnt == -1:
                continue
            now += 1
            mark = block.mark
            if mark < 0:  # used before: its heap entry is refreshed when on top
                block.second_mark = -1 - mark
            else:
                previous = probation.take(block)
                block.second_mark = previous
                heap.push(previous, key)
                used += 1
            block.mark = -1 - now
        self._used += used
        self._now = now

    def _select_blocks(
        self,
        n: int,
        protected: Collection[OffloadKey],
        victim_keys: list[OffloadKey],
        victim_blocks: list[BlockStatus],
    ) -> bool:
        blocks = self._blocks
        guarded = len(protected) > 0  # the manager passes none: skip the membership tests
        chosen: list[OffloadKey] = []
        chosen_blocks: list[BlockStatus] = []  # their blocks, as found: no second lookup
        probation = self._probation
        # The last member chosen before the walk first skipped one: every member up to it
        # leaves, so the next walk may start after it (-1: none).
        taken_through = -1
        passed_over = False
        index = probation.first()
        while index >= 0:
            key = probation.key_at(index)
            block = probation.block
            if block.ref_cnt == 0 and not (guarded and key in protected):
                chosen.append(key)
                chosen_blocks.append(block)
                if not passed_over:
                    taken_through = index
                if len(chosen) == n:
                    break
            else:
                passed_over = True
            index = probation.after(index)
        from_probation = len(chosen)
        heap = self._heap
        # Everything taken off the heap, in order (to undo a failed eviction).
        popped: list[int] = []
        popped_keys: list[OffloadKey] = []
        skipped: list[OffloadKey] = []  # pinned or protected, popped up to date
        while len(chosen) < n and len(heap):
            key = heap.pop()
            stamp = heap.stamp
            popped.append(stamp)
            popped_keys.append(key)
            block = blocks[key]
            current = block.second_mark
            if current != stamp:
                heap.push(current, key)  # used since: its place is further on
                continue
            if block.ref_cnt == 0 and not (guarded and key in protected):
                chosen.append(key)
                chosen_blocks.append(block)
            else:
                skipped.append(key)
        if len(chosen) < n:
            self._restore(popped, popped_keys)
            return False
        ghost = self._ghost
        for i in range(len(chosen)):
            key = chosen[i]
            block = chosen_blocks[i]
            last = probation.take(block) if i < from_probation else -1 - block.mark
            ghost.remember(key, last)
            del blocks[key]
        self._used -= len(chosen) - from_probation
        if taken_through >= 0:
            probation.taken_through(taken_through)
        victim_keys.extend(chosen)  # one call, not an append per victim
        victim_blocks.extend(chosen_blocks)
        for key in skipped:
            heap.push(blocks[key].second_mark, key)
        return True

    def _restore(self, popped: list[int], popped_keys: list[OffloadKey]) -> None:
        """The heap as before a failed eviction, which emptied it: the popped entries less
        the ones it pushed again (an outdated entry's key, popped a second time up to date)."""
        blocks = self._blocks
        refreshed = {
            key
            for stamp, key in zip(popped, popped_keys, strict=True)
            if blocks[key].second_mark != stamp
        }
        self._heap.rebuild(
            {
                stamp: key
                for stamp, key in zip(popped, popped_keys, strict=True)
                if key not in refreshed or blocks[key].second_mark != stamp
            }
        )
