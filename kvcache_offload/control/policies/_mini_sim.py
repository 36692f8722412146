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
from typing import Final, final

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies.base import BlockStatus

__all__ = ["WeightDuel"]

_HASH_SPACE = 1 << 16

# Where a key is in one copy (its ``state``): nowhere, a queue, or a queue's ghosts.
_ABSENT: Final = 0
_PROBATION: Final = 1
_MAIN: Final = 2
_GHOST: Final = 3
_MAIN_GHOST: Final = 4


@final
class _KeyIds:
    """Small ints for the sampled keys, shared by every copy, so that a copy keeps its state
    in lists indexed by id rather than in a dict per queue and ghost list (compiled, a list
    read is a fraction of a dict lookup, and each key is hashed once per request instead of
    several times per copy). An id goes back to the free list once no copy holds its key,
    cached or ghost, and no request in progress uses it: the ids stay as few as the keys
    the copies hold."""

    __slots__ = ("_free", "_ids", "_keys", "caches", "refs")

    def __init__(self) -> None:
        self._ids: dict[OffloadKey, int] = {}
        self._keys: list[OffloadKey | None] = []
        self._free: list[int] = []
        self.refs: list[int] = []  # copies holding the id, plus requests using it
        self.caches: list[_MiniCache] = []

    def pin(self, key: OffloadKey) -> int:
        """The id of ``key`` (a new one if no copy holds it), held until :meth:`release`."""
        index = self._ids.get(key, -1)
        if index < 0:
            if self._free:
                index = self._free.pop()
                self._keys[index] = key
            else:
                index = len(self._keys)
                self._keys.append(key)
                self.refs.append(0)
                for cache in self.caches:
                    cache.state.append(_ABSENT)
                    cache.stamp.append(0)
            self._ids[key] = index
        self.refs[index] += 1
        return index

    def release(self, index: int) -> None:
        """One holder fewer for ``index``; the last one frees it."""
        refs = self.refs[index] - 1
        self.refs[index] = refs
        if refs == 0:
            key = self._keys[index]
            if key is not None:
                del self._ids[key]
            self._keys[index] = None
            self._free.append(index)


@final
class _Log:
    """One queue of a copy, oldest first: (id, stamp) entries from ``head`` on. An entry is
    live while its id is still in this queue (``state`` is ``tag``) with that stamp; a key
    moved on or dropped leaves a dead entry behind, skipped at the head and filtered out
    when dead entries outnumber live ones (the same order as an ordered dict, without a
    dict)."""

    __slots__ = ("head", "ids", "size", "stamps", "tag")

    def __init__(self, tag: int) -> None:
        self.tag = tag
        self.ids: list[int] = []
        self.stamps: list[int] = []
        self.head = 0
        self.size = 0  # live entries

    def append(self, index: int, stamp: int, state: list[int], stamp_of: list[int]) -> None:
        self.ids.append(index)
        self.stamps.append(stamp)
        if len(self.ids) - self.head > 2 * self.size + 64:
            self._compact(state, stamp_of)

    def oldest(self, state: list[int], stamp_of: list[int]) -> int:
        """The position of the oldest live entry, or -1 when the queue is empty."""
        if self.size == 0:
            return -1
        ids, stamps, tag = self.ids, self.stamps, self.tag
        head = self.head
        while True:
            index = ids[head]
            if state[index] == tag and stamp_of[index] == stamps[head]:
                break
            head += 1
        if head > 64 and 2 * head > len(ids):
            del ids[:head]
            del stamps[:head]
            head = 0
        self.head = head
        return head

    def _compact(self, state: list[int], stamp_of: list[int]) -> None:
        ids, stamps, tag = self.ids, self.stamps, self.tag
        live_ids: list[int] = []
        live_stamps: list[int] = []
        for position in range(self.head, len(ids)):
            index = ids[position]
            stamp = stamps[position]
            if state[index] == tag and stamp_of[index] == stamp:
                live_ids.append(index)
                live_stamps.append(stamp)
        self.ids = live_ids
        self.stamps = live_stamps
        self.head = 0


@final
class _MiniCache:
    """The adaptive LRU in miniature, without pinning: new keys on probation, reused ones
    and recently evicted ones (ghosts, at most ``capacity`` per queue) in main.

    Evicts the probation head if its age times ``weight`` is at least the main head's age,
    else the main head (``weight`` 1 is plain LRU; larger weights drop unused keys sooner).
    Keys are :class:`_KeyIds` ids; ``state`` and ``stamp`` (the time of the id's last move)
    are indexed by id.
    """

    __slots__ = (
        "capacity",
        "ghost",
        "hits",
        "ids",
        "main",
        "main_ghost",
        "now",
        "probation",
        "stamp",
        "state",
        "weight",
    )

    def __init__(self, weight: float, capacity: int, ids: _KeyIds) -> None:
        self.weight = weight
        self.capacity = capacity
        self.ids = ids
        self.state: list[int] = [_ABSENT] * len(ids.refs)
        self.stamp: list[int] = [0] * len(ids.refs)
        self.probation = _Log(_PROBATION)
        self.main = _Log(_MAIN)
        self.ghost = _Log(_GHOST)
        self.main_ghost = _Log(_MAIN_GHOST)
        self.now = 0
        self.hits = 0.0

    def access(self, index: int) -> bool:
        """Use the key of id ``index``; True on a hit, else it is stored (evicting one key
        if full)."""
        self.now += 1
        now = self.now
        state, stamp = self.state, self.stamp
        main = self.main
        where = state[index]
        if where == _MAIN:
            stamp[index] = now
            main.append(index, now, state, stamp)
            return True
        if where == _PROBATION:
            self.probation.size -= 1
            state[index] = _MAIN
            stamp[index] = now
            main.size += 1
            main.append(index, now, state, stamp)
            return True
        probation = self.probation
        if where == _ABSENT:
            self.ids.refs[index] += 1
            state[index] = _PROBATION
            stamp[index] = now
            probation.size += 1
            probation.append(index, now, state, stamp)
        else:  # a ghost of either queue: stored again soon after leaving
            if where == _GHOST:
                self.ghost.size -= 1
            else:
                self.main_ghost.size -= 1
            state[index] = _MAIN
            stamp[index] = now
            main.size += 1
            main.append(index, now, state, stamp)
        if probation.size + main.size <= self.capacity:
            return False
        oldest = probation.oldest(state, stamp)
        main_oldest = main.oldest(state, stamp)
        if oldest >= 0 and (
            main_oldest < 0
            or (now - probation.stamps[oldest]) * self.weight >= now - main.stamps[main_oldest]
        ):
            self._remember(probation, oldest, self.ghost, now)
        elif main_oldest >= 0:
            self._remember(main, main_oldest, self.main_ghost, now)
        return False

    def _remember(self, queue: _Log, position: int, ghosts: _Log, now: int) -> None:
        """Evict the entry at ``position`` (a queue's oldest) into ``ghosts``, forgetting
        the oldest ghost beyond ``capacity``."""
        state, stamp = self.state, self.stamp
        index = queue.ids[position]
        queue.size -= 1
        state[index] = ghosts.tag
        stamp[index] = now
        ghosts.size += 1
        ghosts.append(index, now, state, stamp)
        if ghosts.size > self.capacity:
            gone = ghosts.ids[ghosts.oldest(state, stamp)]
            state[gone] = _ABSENT
            ghosts.size -= 1
            self.ids.release(gone)

    def __len__(self) -> int:
        return self.probation.size + self.main.size


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
    ) -> None:
        rate = min(1.0, max(shadow_blocks / max(cache_capacity, 1), min_rate))
        self.rate = rate
        self._threshold = max(1, round(rate * _HASH_SPACE))
        capacity = max(1, round(rate * cache_capacity))
        self._ids = _KeyIds()
        self._caches = [_MiniCache(w, capacity, self._ids) for w in weights]
        self._ids.caches = self._caches
        self._decay_every = decay_every
        self._steps = 0
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
        ``decay_every`` sampled keys the weight is re-chosen.
        """
        table = self._ids
        indices = [table.pin(key) for key in keys]
        for cache in self._caches:
            # Hits since the last miss, tail first: the hits before the first miss in
            # prefix order.
            score = 0
            for index in reversed(indices):
                score = score + 1 if cache.access(index) else 0
            cache.hits += score
        for index in indices:
            table.release(index)
        self._steps += len(keys)
        if self._steps >= self._decay_every:
            self._steps = 0
            best = self._caches[0]
            for cache in self._caches:
                if cache.hits > best.hits:
                    best = cache
            self.weight = best.weight
            for cache in self._caches:
                cache.hits *= 0.5

    def sizes(self) -> list[int]:
        return [len(c) for c in self._caches]

    def hit_counts(self) -> dict[float, float]:
        return {c.weight: c.hits for c in self._caches}
