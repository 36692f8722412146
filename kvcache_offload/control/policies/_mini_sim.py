"""Miniature simulations that pick the adaptive LRU's probation weight online.

Waldspurger et al. (ATC'17, "Cache modeling and optimization using miniature simulations"):
a cache fed a spatially hashed sample of the keys, scaled down by the sampling rate, shows
the hit ratio of the full-size cache. Here several small copies of the adaptive LRU run side
by side, one per candidate weight, on the same sample; the policy uses the weight whose copy
hits most, with exponentially decaying hit counts so it follows shifts in the workload.
Memory is bounded: each copy holds at most ``rate x capacity`` keys (a few hundred) plus
as many ghost keys per queue, like the policy it models.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import final

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._ghosts import GhostList
from kvcache_offload.control.policies._stamp_queue import StampQueue
from kvcache_offload.control.policies.base import BlockStatus

__all__ = ["WeightDuel"]

_HASH_SPACE = 1 << 16


@final
class _MiniCache:
    """The adaptive LRU in miniature, without pinning: new keys on probation, reused ones
    and recently evicted ones (ghosts) in main.

    Evicts the probation head if its age times ``weight`` is at least the main head's age,
    else the main head (``weight`` 1 is plain LRU; larger weights drop unused keys sooner).
    """

    __slots__ = ("capacity", "ghost", "hits", "main", "main_ghost", "now", "probation", "weight")

    def __init__(self, weight: float, capacity: int) -> None:
        self.weight = weight
        self.capacity = capacity
        # key -> stamp: insertion time on probation, last use in main (StampQueue: cheaper
        # than an OrderedDict when compiled, same order).
        self.probation = StampQueue()
        self.main = StampQueue()
        self.ghost = GhostList(capacity)
        self.main_ghost = GhostList(capacity)
        self.now = 0
        self.hits = 0.0

    def access(self, key: OffloadKey) -> bool:
        """Use ``key``; True on a hit, else it is stored (evicting one key if full)."""
        self.now += 1
        now = self.now
        main = self.main
        if key in main.stamps:
            main.push(key, now)
            return True
        probation = self.probation
        if key in probation.stamps:
            probation.remove(key)
            main.push(key, now)
            return True
        if self.ghost.recall(key) or self.main_ghost.recall(key):
            main.push(key, now)
        else:
            probation.push(key, now)
        if len(probation.stamps) + len(main.stamps) <= self.capacity:
            return False
        # Each head looked up once (``drop_found``, not ``pop_oldest``).
        oldest = probation.oldest()
        main_oldest = main.oldest()
        if oldest is not None and (
            main_oldest is None
            or (now - probation.oldest_stamp()) * self.weight >= now - main.oldest_stamp()
        ):
            probation.drop_found()
            self.ghost.remember(oldest)
        elif main_oldest is not None:
            main.drop_found()
            self.main_ghost.remember(main_oldest)
        return False

    def __len__(self) -> int:
        return len(self.probation) + len(self.main)


class WeightDuel:
    """Runs one miniature cache per candidate weight on a hashed sample of the accesses."""

    def __init__(
        self,
        cache_capacity: int,
        weights: Sequence[float],
        *,
        shadow_blocks: int = 512,
        min_rate: float = 0.001,
        decay_every: int = 1024,
        initial_weight: float = 1.0,
        margin: float = 0.0,
    ) -> None:
        rate = min(1.0, max(shadow_blocks / max(cache_capacity, 1), min_rate))
        self.rate = rate
        self._threshold = max(1, round(rate * _HASH_SPACE))
        capacity = max(1, round(rate * cache_capacity))
        self._caches = [_MiniCache(w, capacity) for w in weights]
        self._decay_every = decay_every
        self._steps = 0
        self._margin = margin
        self.weight = initial_weight

    def sampled(self, key: OffloadKey) -> bool:
        """Whether ``key`` is in the sample (a deterministic hash, so replays repeat)."""
        return (zlib.crc32(key) & 0xFFFF) < self._threshold

    def sample(
        self, keys: Sequence[OffloadKey], blocks: dict[OffloadKey, BlockStatus]
    ) -> list[OffloadKey]:
        """The sampled ``keys`` in order, less those of ``blocks`` being written (a store
        just prepared is not an access): one loop instead of two calls per key."""
        threshold = self._threshold
        crc = zlib.crc32
        out: list[OffloadKey] = []
        for key in keys:
            if (crc(key) & 0xFFFF) < threshold:
                block = blocks.get(key)
                if block is None or block.ref_cnt != -1:
                    out.append(key)
        return out

    def access(self, keys: Sequence[OffloadKey]) -> None:
        """The sampled keys of one request, in prefix order.

        Each copy uses them tail first (as ``touch`` does) and scores the hits up to its
        first miss in prefix order: past a miss the real lookup would stop too. Every
        ``decay_every`` sampled keys the weight is re-chosen: the best copy's, unless it
        beats the first copy (weight 1, plain LRU) by less than ``margin`` (relative), in
        which case LRU's. Sampling noise then settles on LRU, not on a weight that only
        looked better (on the synthetic trace that fell below LRU).
        """
        for cache in self._caches:
            # Hits since the last miss, tail first: the hits before the first miss in
            # prefix order.
            score = 0
            for key in reversed(keys):
                score = score + 1 if cache.access(key) else 0
            cache.hits += score
        self._steps += len(keys)
        if self._steps >= self._decay_every:
            self._steps = 0
            first = best = self._caches[0]
            for cache in self._caches:
                if cache.hits > best.hits:
                    best = cache
            if best.hits < (1.0 + self._margin) * first.hits:
                best = first
            self.weight = best.weight
            for cache in self._caches:
                cache.hits *= 0.5

    def sizes(self) -> list[int]:
        return [len(c) for c in self._caches]

    def hit_counts(self) -> dict[float, float]:
        return {c.weight: c.hits for c in self._caches}
