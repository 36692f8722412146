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
heap keyed by their second-last access, with stale entries skipped and compacted lazily.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from heapq import heapify, heappop, heappush
from typing import ClassVar

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._prefix_batch import QueuePolicy
from kvcache_offload.control.policies.base import BlockStatus

__all__ = ["LRU2CachePolicy"]

_Entry = tuple[int, int, OffloadKey]
"""(second-last access, last access, key) of a used block; stale once the key moves on."""


class _Heap:
    """The used blocks' entries, oldest second-last access first (a binary heap).

    Shown (``repr``) in sorted order: a failed eviction pops and pushes back entries, which
    can reorder the list but never changes what it holds.
    """

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[_Entry] = []

    def push(self, entry: _Entry) -> None:
        heappush(self.entries, entry)

    def pop(self) -> _Entry:
        return heappop(self.entries)

    def rebuild(self, entries: list[_Entry]) -> None:
        heapify(entries)
        self.entries = entries

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return repr(sorted(self.entries))


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class LRU2CachePolicy(QueuePolicy):
    """Probation (used once) first, then used blocks by oldest second-last access."""

    name = "lru2"
    queue_attributes = ("_probation", "_main", "_ghost")
    prefix_order = True
    history: ClassVar[float] = 8.0
    """Evicted keys remembered (with their last access), as a multiple of the capacity."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        # key -> time of its only access (its store), oldest first.
        self._probation: OrderedDict[OffloadKey, int] = OrderedDict()
        # key -> (second-last access, last access) for used blocks; the heap orders them.
        self._main: dict[OffloadKey, tuple[int, int]] = {}
        self._heap = _Heap()
        # Evicted key -> its last access, oldest first, at most ``capacity`` of them.
        self._ghost: OrderedDict[OffloadKey, int] = OrderedDict()
        self._now = 0
        self._history = max(1, int(self.history * cache_capacity))

    def _reset_learning(self) -> None:
        self._heap.clear()
        self._now = 0

    def _enqueue(self, key: OffloadKey, block: BlockStatus) -> None:
        self._now += 1
        last = self._ghost.pop(key, -1)
        if last < 0:
            self._probation[key] = self._now
        else:
            self._to_main(key, last)

    def _to_main(self, key: OffloadKey, previous: int) -> None:
        now = self._now
        self._main[key] = (previous, now)
        self._heap.push((previous, now, key))

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._flush_batch()
        blocks, probation, main, heap = self._blocks, self._probation, self._main, self._heap
        now = self._now  # in a local, stored back at the end
        for key in reversed(keys):
            block = blocks.get(key)
            if block is None or block.ref_cnt == -1:
                continue
            now += 1
            stamps = main.get(key)
            previous = stamps[1] if stamps is not None else probation.pop(key)
            main[key] = (previous, now)
            heap.push((previous, now, key))
        self._now = now
        if len(self._heap) > 2 * len(main) + 64:
            self._heap.rebuild([(s, t, k) for k, (s, t) in main.items()])

    def _select(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        blocks = self._blocks
        chosen: list[OffloadKey] = []
        for key in self._probation:
            if blocks[key].ref_cnt == 0 and key not in protected:
                chosen.append(key)
                if len(chosen) == n:
                    break
        from_probation = len(chosen)
        heap, main = self._heap, self._main
        popped: list[_Entry] = []
        stale: list[_Entry] = []
        while len(chosen) < n and len(heap):
            entry = heap.pop()
            key = entry[2]
            stamps = main.get(key)
            if stamps is None or stamps[1] != entry[1]:
                stale.append(entry)  # the key was used again or left
                continue
            popped.append(entry)
            if blocks[key].ref_cnt == 0 and key not in protected:
                chosen.append(key)
        if len(chosen) < n:
            for entry in popped + stale:  # as it was: a failed eviction changes nothing
                heap.push(entry)
            return None
        victims = []
        for i, key in enumerate(chosen):
            last = self._probation.pop(key) if i < from_probation else main.pop(key)[1]
            self._remember(key, last)
            victims.append((key, blocks.pop(key)))
        for entry in popped:
            if entry[2] in main:  # skipped (pinned or protected): back in the heap
                heap.push(entry)
        return victims

    def _remember(self, key: OffloadKey, last: int) -> None:
        ghost = self._ghost
        ghost[key] = last
        if len(ghost) > self._history:
            ghost.popitem(last=False)
