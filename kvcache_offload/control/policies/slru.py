"""Segmented LRU: a probation segment for blocks seen once, a protected one for reused blocks.

A block that is only stored never pushes a reused block out: eviction takes the probation
segment's least recent idle block first and the protected segment only when probation has
none. Keys evicted from the protected segment are remembered (ghosts, at most the capacity)
and a store of one of them goes straight back into the protected segment.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from typing import ClassVar

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._ghosts import GhostList
from kvcache_offload.control.policies._prefix_batch import QueuePolicy
from kvcache_offload.control.policies.base import Blocks, BlockStatus, Keys, Protected

__all__ = ["SLRUCachePolicy"]


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class SLRUCachePolicy(QueuePolicy):
    """SLRU with ``protected_ratio`` of the capacity for the protected segment.

    ``touch`` promotes a ready probation block to the protected segment's most recent end;
    when that segment outgrows its share, its least recent block drops back to probation.
    A store just prepared (``ref_cnt == -1``) only refreshes its probation recency.
    """

    name = "slru"
    queue_attributes = ("_probation", "_protected", "_ghost")
    protected_ratio: ClassVar[float] = 0.8

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._probation: OrderedDict[OffloadKey, None] = OrderedDict()
        self._protected: OrderedDict[OffloadKey, None] = OrderedDict()
        self._ghost = GhostList(cache_capacity)
        self._protected_target = int(cache_capacity * self.protected_ratio)

    def _enqueue(self, key: OffloadKey, block: BlockStatus) -> None:
        if self._ghost.recall(key):
            self._protected[key] = None
            self._demote_overflow()
        else:
            self._probation[key] = None

    def _demote_overflow(self) -> None:
        protected, probation = self._protected, self._probation
        while len(protected) > self._protected_target:
            key, _ = protected.popitem(last=False)
            probation[key] = None

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._flush_batch()
        blocks, probation, protected = self._blocks, self._probation, self._protected
        promoted = False
        for key in reversed(keys):
            block = blocks.get(key)
            if block is None:
                continue
            if key in protected:
                protected.move_to_end(key)
            elif block.ref_cnt == -1:
                probation.move_to_end(key)
            else:
                del probation[key]
                protected[key] = None
                promoted = True
        if promoted:
            self._demote_overflow()

    def _candidates(
        self, segment: OrderedDict[OffloadKey, None], protected: Collection[OffloadKey]
    ) -> Iterator[OffloadKey]:
        blocks = self._blocks
        for key in segment:
            if blocks[key].ref_cnt == 0 and key not in protected:
                yield key

    def _select_blocks(self, n: int, protected: Protected, keys: Keys, blocks: Blocks) -> bool:
        from_probation: list[OffloadKey] = []
        for key in self._candidates(self._probation, protected):
            from_probation.append(key)
            if len(from_probation) == n:
                break
        from_protected: list[OffloadKey] = []
        if len(from_probation) < n:
            for key in self._candidates(self._protected, protected):
                from_protected.append(key)
                if len(from_probation) + len(from_protected) == n:
                    break
            else:
                return False
        table = self._blocks
        for key in from_probation:
            del self._probation[key]
            block = table[key]  # get and del: compiled, ``dict.pop`` is a generic call
            del table[key]
            keys.append(key)
            blocks.append(block)
        ghost = self._ghost
        for key in from_protected:
            del self._protected[key]
            ghost.remember(key)
            block = table[key]
            del table[key]
            keys.append(key)
            blocks.append(block)
        return True
