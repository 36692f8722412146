"""Adaptive Replacement Cache with vLLM's touch-driven adaptation.

T1 holds blocks seen once, T2 blocks seen again; ghost lists B1/B2 remember recently evicted
keys and steer the target size of T1. Two deliberate fixes over vLLM's classic version:
eviction is one monotonic pass over each list (not a rescan from the head per victim), and
when T2 has no evictable block left eviction falls back to T1 instead of failing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence

from kvcache_offload.base import OffloadKey
from kvcache_offload.cpu.policies.base import BlockStatus, CachePolicy

__all__ = ["ARCCachePolicy"]


def _take(
    entries: Iterator[tuple[OffloadKey, BlockStatus]], count: int, protected: Collection[OffloadKey]
) -> list[tuple[OffloadKey, BlockStatus]]:
    """Up to ``count`` idle, unprotected entries from ``entries``, which is left positioned
    after the last one taken so a later call continues the same pass."""
    taken: list[tuple[OffloadKey, BlockStatus]] = []
    if count <= 0:
        return taken
    for key, block in entries:
        if block.ref_cnt == 0 and key not in protected:
            taken.append((key, block))
            if len(taken) == count:
                break
    return taken


class ARCCachePolicy(CachePolicy):
    """ARC as vLLM drives it: adaptation on ``touch`` of ghost keys, new blocks enter T1."""

    name = "arc"

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity
        self.target_t1_size = 0.0
        self.t1: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> BlockStatus | None:
        block = self.t1.get(key)
        if block is None:
            block = self.t2.get(key)
        return block

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.t1[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def insert_many(self, pairs: Sequence[tuple[OffloadKey, BlockStatus]]) -> None:
        self.t1.update(pairs)
        b1, b2 = self.b1, self.b2
        if b1 or b2:
            for key, _ in pairs:
                b1.pop(key, None)
                b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            del self.t2[key]

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        capacity = self.cache_capacity
        t1_get, t1_move, t2_move = t1.get, t1.move_to_end, t2.move_to_end
        for key in reversed(keys):
            block = t1_get(key)
            if block is not None:
                if block.ref_cnt == -1:
                    # A store just prepared is not a second access.
                    t1_move(key)
                else:
                    del t1[key]
                    t2[key] = block
            elif key in t2:
                t2_move(key)
            elif key in b1:
                delta = max(1.0, len(b2) / len(b1))
                self.target_t1_size = min(self.target_t1_size + delta, float(capacity))
                b1.move_to_end(key)
            elif key in b2:
                delta = max(1.0, len(b1) / len(b2))
                self.target_t1_size = max(self.target_t1_size - delta, 0.0)
                b2.move_to_end(key)

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        t1, t2 = self.t1, self.t2
        # Victim i comes from T1 while |T1| - (T1 victims so far) >= int(p): that is, the
        # first len(T1) - int(p) + 1 victims (capped to n), the rest from T2; when T2 has no
        # evictable block left, from T1 after all (vLLM #55461). Each list is walked once.
        from_t1_target = len(t1) - int(self.target_t1_size) + 1
        from_t1_target = 0 if from_t1_target < 0 else min(from_t1_target, n)
        t1_iter = iter(t1.items())
        from_t1 = _take(t1_iter, from_t1_target, protected)
        from_t2 = _take(iter(t2.items()), n - len(from_t1), protected)
        fallback: list[tuple[OffloadKey, BlockStatus]] = []
        missing = n - len(from_t1) - len(from_t2)
        if missing:
            fallback = _take(t1_iter, missing, protected)
            if len(fallback) < missing:
                return None
        b1, b2 = self.b1, self.b2
        for key, _ in from_t1:
            del t1[key]
            b1[key] = None
        for key, _ in fallback:
            del t1[key]
            b1[key] = None
        for key, _ in from_t2:
            del t2[key]
            b2[key] = None
        capacity = self.cache_capacity
        for ghosts in (b1, b2):
            excess = len(ghosts) - capacity
            popitem = ghosts.popitem
            for _ in range(excess):
                popitem(last=False)
        if fallback:
            return from_t1 + from_t2 + fallback
        if from_t2:
            return from_t1 + from_t2
        return from_t1

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def debug_state(self) -> dict[str, object]:
        return {
            "size": len(self),
            "t1": len(self.t1),
            "t2": len(self.t2),
            "b1": len(self.b1),
            "b2": len(self.b2),
            "target_t1_size": self.target_t1_size,
        }
