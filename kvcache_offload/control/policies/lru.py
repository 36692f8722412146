"""Least-recently-used eviction over one ordered dict (front = least recent)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies.base import (
    Blocks,
    BlockStatus,
    Keys,
    ListEvictionPolicy,
    Protected,
)

__all__ = ["LRUCachePolicy"]


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class LRUCachePolicy(ListEvictionPolicy):
    """vLLM's LRU: insertion and ``touch`` move a key to the most-recent end.

    Completing a load is not a use (recency only changes on insert and touch), so the order
    matches vLLM's classic policy exactly. Eviction walks from the least-recent end once,
    skipping pinned or protected blocks, and stops after ``n`` victims.
    """

    name = "lru"
    chooses_ahead = True  # a new block is the most recent: never chosen before an older one

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.blocks: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        # Whether ``insert_blocks`` may fill the dict itself: not when a subclass changed how
        # a block is inserted (its ``insert`` or ``insert_many`` must still see every one).
        cls = type(self)
        self._plain_insert = (
            cls.insert is LRUCachePolicy.insert and cls.insert_many is LRUCachePolicy.insert_many
        )

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.blocks[key] = block

    def insert_many(self, pairs: Sequence[tuple[OffloadKey, BlockStatus]]) -> None:
        self.blocks.update(pairs)

    def insert_blocks(self, keys: list[OffloadKey], blocks: list[BlockStatus]) -> None:
        if not self._plain_insert:
            super().insert_blocks(keys, blocks)
            return
        table = self.blocks
        for index in range(len(keys)):  # compiled: a store per key, no generic ``update``
            table[keys[index]] = blocks[index]

    def remove(self, key: OffloadKey) -> None:
        del self.blocks[key]

    def block_table(self) -> dict[OffloadKey, BlockStatus]:
        return self.blocks

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        blocks = self.blocks
        move = blocks.move_to_end
        for key in reversed(keys):
            if key in blocks:
                move(key)

    def _evict_into(self, n: int, protected: Protected, keys: Keys, blocks: Blocks) -> bool:
        """The one walk of both eviction forms: the victims appended to the lists, or False
        having appended nothing."""
        if n <= 0:
            return True
        start, blocks_start = len(keys), len(blocks)
        found = 0
        guarded = len(protected) > 0
        table = self.blocks
        for key, block in table.items():
            if block.ref_cnt == 0 and not (guarded and key in protected):
                keys.append(key)
                blocks.append(block)
                found += 1
                if found == n:
                    break
        else:
            del keys[start:]
            del blocks[blocks_start:]
            return False
        for index in range(start, len(keys)):
            del table[keys[index]]
        return True

    def reinstate_blocks(self, keys: list[OffloadKey], blocks: list[BlockStatus]) -> None:
        # Back at the least-recent end, the earliest chosen first: where eviction took them
        # (a pinned block they had passed over may now stand behind them).
        if not self._plain_insert:  # a subclass's ``insert`` sees them
            super().reinstate_blocks(keys, blocks)
            return
        table = self.blocks
        for index in range(len(keys) - 1, -1, -1):
            key = keys[index]
            table[key] = blocks[index]
            table.move_to_end(key, last=False)

    def clear(self) -> None:
        self.blocks.clear()

    def __len__(self) -> int:
        return len(self.blocks)
