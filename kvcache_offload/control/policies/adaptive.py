"""An eviction policy that runs whichever candidate policy its miniature simulations favour.

No single policy wins everywhere in the lab (``docs/policy-lab.md``): LRU-2 is far ahead in
small caches under a flood of one-off prefixes, the adaptive LRU in most other places (and,
at weight 1, plain LRU where the cache holds nearly all the reuse). This policy serves with
one candidate at a time (starting with the first, the adaptive LRU) while every candidate
runs in miniature on a hashed sample of the keys (:mod:`._shadow_race`); when another
candidate's miniature has led by a margin twice in a row, the live cache switches to it.
S3-FIFO and plain LRU are not candidates: raced in the lab, neither ever took over on either
trace, at any capacity or slice, and their miniatures cost as much as the others.

The miniatures are shared: the race's miniature of the adaptive LRU does not run weight
miniatures of its own while the adaptive LRU serves, but follows the live policy's weight
(chosen on the live traffic, exactly as the adaptive LRU alone would), so they run once;
while another candidate serves, it runs its own again. Until a switch, the live cache
decides exactly as the first candidate alone.

A switch hands the blocks over in the old policy's eviction order: the old policy is drained
victim by victim (pinned and unfinished blocks last) and the new one takes each block as if
it had been stored and then used in that order, so what the old policy valued most is what
the new one keeps longest. It costs one pass over the cache, and switches are rare.

The live policy sees every call the manager makes; the miniatures see the first ``touch`` of
each request (the one after a store repeats it) reduced to its sampled keys. While the live
candidate's miniature leads every other one widely, the race rests (the miniatures see
nothing for ``rest_windows`` evaluation windows of traffic, then race again): on the
conversation trace at 1 % the race runs for a fifth of the trace instead of all of it, with
the same decisions on both traces at every capacity of the lab (``docs/policy-lab.md``,
"The default: `adaptive`"). A live LRU-2 keeps its blocks in this policy's table, as the
adaptive LRU does, so a store or an eviction updates one dict.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._shadow_race import ShadowRace
from kvcache_offload.control.policies.alru import AdaptiveLRUCachePolicy
from kvcache_offload.control.policies.base import (
    Blocks,
    BlockStatus,
    CachePolicy,
    Keys,
    ListEvictionPolicy,
    Protected,
)
from kvcache_offload.control.policies.lru2 import LRU2CachePolicy
from kvcache_offload.control.policies.registry import get_cache_policy_cls

__all__ = ["AdaptiveCachePolicy"]

_NONE: frozenset[OffloadKey] = frozenset()


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class AdaptiveCachePolicy(ListEvictionPolicy):
    """Serves with the candidate whose miniature hits most (see module doc)."""

    name = "adaptive"
    candidates: ClassVar[tuple[str, ...]] = ("alru", "lru2")
    """Registered policy names; the first one serves until the race names another."""
    shadow_blocks: ClassVar[int] = 256
    """Size of each miniature (the sampling rate is this over the capacity)."""
    margin: ClassVar[float] = 0.05
    """How much more a challenger's miniature must hit, relatively, to take over."""
    window: ClassVar[float] = 4.0
    """Sampled blocks per evaluation of the race, in miniature capacities."""
    rest_lead: ClassVar[float] = 0.25
    """How far (relatively) the leader's miniature must lead every other one for a rest."""
    rest_after: ClassVar[int] = 2
    """Evaluations in a row with such a lead before the race rests."""
    rest_windows: ClassVar[float] = 12.0
    """Length of a rest in evaluation windows of traffic (0: the race never rests)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._blocks: dict[OffloadKey, BlockStatus] = {}
        self._classes = {name: get_cache_policy_cls(name) for name in self.candidates}
        # Whether ``insert_blocks`` may pass the manager's lists to the live policy: not
        # when a subclass changed ``insert_many`` (it must still see every insert).
        self._plain_insert = type(self).insert_many is AdaptiveCachePolicy.insert_many
        self._start()

    def _start(self) -> None:
        first = self.candidates[0]
        self._live_name = first
        self._race = ShadowRace(
            self.cache_capacity,
            list(self._classes.items()),
            shadow_blocks=self.shadow_blocks,
            margin=self.margin,
            window=self.window,
            rest_lead=self.rest_lead,
            rest_after=self.rest_after,
            rest_windows=self.rest_windows,
        )
        self._set_live(self._classes[first](self.cache_capacity))
        self._last_stored: OffloadKey | None = None
        self._share_miniatures(self._live, first)

    def _set_live(self, live: CachePolicy) -> None:
        """Serve with ``live``; an adaptive LRU draws the race's sample with its own (one
        CRC per key for both) and keeps its blocks in this policy's table."""
        self._live: CachePolicy = live
        self._live_alru: AdaptiveLRUCachePolicy | None = None
        self._shared = False
        if isinstance(live, AdaptiveLRUCachePolicy):
            live.share_hash(self._race.threshold)
            # It holds the same blocks: one table for both (``_shared``).
            live.adopt_table(self._blocks)
            self._live_alru = live
            self._shared = True
        elif isinstance(live, LRU2CachePolicy):
            live.adopt_table(self._blocks)
            self._shared = True

    def _share_miniatures(self, live: CachePolicy, name: str) -> None:
        """The race's adaptive LRU follows ``live`` when that is one, or leads (see module
        doc)."""
        for candidate in self.candidates:
            twin = self._race.policy(candidate)
            if isinstance(twin, AdaptiveLRUCachePolicy):
                if candidate == name and isinstance(live, AdaptiveLRUCachePolicy):
                    twin.follow(live)
                else:
                    twin.lead()

    @property
    def live_policy(self) -> str:
        """The candidate serving now."""
        return self._live_name

    # -- storage -------------------------------------------------------------------------

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    def block_table(self) -> dict[OffloadKey, BlockStatus]:
        return self._blocks

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        if not self._shared:
            self._blocks[key] = block
        self._live.insert(key, block)
        self._last_stored = key

    def insert_many(self, pairs: Sequence[tuple[OffloadKey, BlockStatus]]) -> None:
        if not pairs:
            return
        if not self._shared:
            self._blocks.update(pairs)
        self._live.insert_many(pairs)
        self._last_stored = pairs[-1][0]

    def insert_blocks(self, keys: list[OffloadKey], blocks: list[BlockStatus]) -> None:
        # :meth:`insert_many` of the pairs without building them (the manager's call).
        if not self._plain_insert:
            super().insert_blocks(keys, blocks)
            return
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys for {len(blocks)} blocks")
        if not keys:
            return
        if not self._shared:
            table = self._blocks
            for index in range(len(keys)):
                table[keys[index]] = blocks[index]
        self._live.insert_blocks(keys, blocks)
        self._last_stored = keys[-1]

    def remove(self, key: OffloadKey) -> None:
        if not self._shared:
            del self._blocks[key]
        self._live.remove(key)

    # -- use and eviction ----------------------------------------------------------------

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._live.touch(keys)
        stored = self._last_stored
        if stored is not None:
            self._last_stored = None
            block = self._blocks.get(stored)
            if block is not None and block.ref_cnt == -1 and stored in keys:
                return  # the touch after this request's store: the race saw the request
        race = self._race
        if race.rest_keys > 0:  # resting (see ShadowRace): the miniatures skip it
            race.rest_keys -= len(keys)
            return
        live = self._live_alru
        if live is not None and live.race_source is keys:
            sampled = ShadowRace.distinct(live.race_keys)
        else:
            sampled = self._race.sample(keys)
        if sampled and self._race.request(sampled):
            self._switch(self._race.leader)

    def _evict_into(self, n: int, protected: Protected, keys: Keys, blocks: Blocks) -> bool:
        """Both eviction forms: the live policy fills the manager's lists directly."""
        start = len(keys)
        if not self._live.evict_blocks(n, protected, keys, blocks):
            return False
        if not self._shared:
            table = self._blocks
            for index in range(start, len(keys)):
                del table[keys[index]]
        return True

    def _switch(self, name: str) -> None:
        old = self._live
        if self._shared:
            # Drained on a table of its own: this one keeps every block, in its order.
            if isinstance(old, (AdaptiveLRUCachePolicy, LRU2CachePolicy)):
                old.adopt_table(dict(self._blocks))
            self._shared = False
        order: list[tuple[OffloadKey, BlockStatus]] = []
        while True:
            victim = old.evict(1, _NONE)
            if not victim:
                break
            order.extend(victim)
        drained = {key for key, _ in order}
        order.extend((key, block) for key, block in self._blocks.items() if key not in drained)
        new = self._classes[name](self.cache_capacity)
        self._share_miniatures(new, name)
        for pair in order:
            new.insert_many([pair])
            new.touch([pair[0]])
        self._set_live(new)
        self._live_name = name

    def clear(self) -> None:
        self._blocks.clear()
        self._start()

    def __len__(self) -> int:
        return len(self._blocks)

    def debug_state(self) -> dict[str, object]:
        return {
            "size": len(self),
            "live": self._live_name,
            "switches": self._race.switches,
            "race_rests": self._race.rests,
            "scores": self._race.scores(),
            "shadow_hit_ratios": self._race.hit_ratios(),
            "live_state": self._live.debug_state(),
        }
