"""SIEVE (Zhang et al., NSDI'24): one FIFO, a visited bit per block and a moving hand.

A hit only sets a bit; the hand sweeps from old to new, clearing bits and evicting the
first unvisited idle block, and survivors keep their place. Cheap hits and quick removal
of blocks that are never read again, with no second queue to size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from itertools import chain
from typing import Final

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._prefix_batch import PlannedQueuePolicy
from kvcache_offload.control.policies._virtual_fifo import VirtualFifo
from kvcache_offload.control.policies.base import BlockStatus

__all__ = ["SIEVECachePolicy"]

# The moves of a plan. Final: compiled, a plain module constant is a dict lookup per read.
_KEEP: Final = 0
_CLEAR: Final = 1
_EVICT: Final = 2


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class SIEVECachePolicy(PlannedQueuePolicy):
    """SIEVE with the queue split at the hand.

    ``_ahead`` holds the blocks from the hand to the newest (new blocks join its end);
    ``_behind`` the blocks the hand already passed in this lap, oldest first. When the hand
    reaches the newest block it wraps: ``_behind`` becomes ``_ahead``. Both are ordered
    dicts, so every step is O(1). Pinned and protected blocks are passed over unchanged.
    """

    name = "sieve"
    queue_attributes = ("_ahead", "_behind")

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._ahead: OrderedDict[OffloadKey, None] = OrderedDict()
        self._behind: OrderedDict[OffloadKey, None] = OrderedDict()
        # A block's visited bit is its ``mark`` (1 set, 0 clear): no per-key dict to probe.

    def _learned_state(self) -> dict[str, object]:
        return {"visited": sum(1 for block in self._blocks.values() if block.mark)}

    def _enqueue(self, key: OffloadKey, block: BlockStatus) -> None:
        block.mark = 0
        self._ahead[key] = None

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._flush_batch()
        blocks = self._blocks
        for key in reversed(keys):
            block = blocks.get(key)
            # A store just prepared is not an access.
            if block is not None and block.ref_cnt != -1:
                block.mark = 1

    def _plan(
        self,
        n: int,
        protected: Collection[OffloadKey],
        moves: list[int],
        keys: list[OffloadKey],
        found: list[BlockStatus],
    ) -> bool:
        """The hand's moves until ``n`` victims, without changing anything; False if stuck.

        The walk reads the queue in hand order and then the blocks it passed over (kept),
        so it may lap; a whole lap with neither a victim nor a bit cleared means the
        remaining blocks are all pinned or protected.
        """
        blocks = self._blocks
        guarded = len(protected) > 0  # the manager passes none: skip the membership tests
        walk = VirtualFifo(chain(self._ahead, self._behind))
        cleared: set[OffloadKey] = set()
        victims = 0
        idle_steps = 0
        limit = len(blocks)
        while victims < n:
            key = walk.pop()
            if key is None or idle_steps > limit:
                return False
            block = blocks[key]
            keys.append(key)
            found.append(block)
            if block.ref_cnt != 0 or (guarded and key in protected):
                moves.append(_KEEP)
                walk.append(key)
                idle_steps += 1
            elif block.mark and key not in cleared:
                cleared.add(key)
                moves.append(_CLEAR)
                walk.append(key)
                idle_steps = 0
            else:
                moves.append(_EVICT)
                victims += 1
                idle_steps = 0
        return True

    def _apply(
        self,
        moves: list[int],
        keys: list[OffloadKey],
        found: list[BlockStatus],
        victim_keys: list[OffloadKey],
        victim_blocks: list[BlockStatus],
    ) -> None:
        blocks = self._blocks
        for index in range(len(keys)):
            step = moves[index]
            key = keys[index]
            if not self._ahead:
                self._ahead, self._behind = self._behind, self._ahead
            # The hand's key is the oldest of ``_ahead``: deleting it by key is
            # ``popitem(last=False)`` without a method call by name (costly when compiled).
            del self._ahead[key]
            if step == _EVICT:
                del blocks[key]  # the plan's block: no second lookup
                victim_keys.append(key)
                victim_blocks.append(found[index])
            else:
                self._behind[key] = None
                if step == _CLEAR:
                    found[index].mark = 0
