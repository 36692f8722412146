"""Adaptive LRU for prefix caches: probation weighted by a miniature-simulation duel.

Blocks that were stored but never used since sit on probation; used blocks sit in the main
LRU, and so do blocks stored again soon after eviction (their keys are remembered as ghosts,
at most ``capacity`` per queue). Eviction compares the oldest idle block of each queue:
probation goes first if its age times ``weight`` is at least the main block's age. Weight
1 is exactly LRU (best when the cache holds most of the reuse); larger weights drop
never-reused blocks sooner (best when the cache is small and one-off prefixes would flush
it). The weight is chosen online by running a small copy of this policy per candidate
weight on a hashed sample of the keys
(:mod:`._mini_sim`), fed the first ``touch`` of each request only: the one right after a
store repeats the request's hit prefix, which every copy hits alike, so it would cost the
copies work and tell them nothing. A policy may also
:meth:`~AdaptiveLRUCachePolicy.follow` another one's copies instead of running its own (the
adaptive policy's miniature of this policy follows the live one, so the copies run once).

Two prefix-specific rules, since a lookup stops at a prefix's first miss:

* a store's keys are enqueued tail first and ``touch`` leaves the first key most recent, so
  a prefix loses its tail before its head;
* the policy measures how often the last block of a store is used again compared with the
  other blocks; when it is used far less (a prompt's partial last block, which the next
  turn rewrites, as in the Mooncake traces), that block goes to the front of the probation
  queue, so it is the first to leave. When last blocks are reused like the rest (vLLM
  stores full blocks only), nothing changes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from typing import ClassVar, Final

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._ghosts import GhostList
from kvcache_offload.control.policies._mini_sim import WeightDuel
from kvcache_offload.control.policies._prefix_batch import QueuePolicy
from kvcache_offload.control.policies.base import BlockStatus

__all__ = ["AdaptiveLRUCachePolicy"]

_DEMOTED: Final = -(1 << 62)
"""Stamp of a demoted block: older than anything, so it is the first to go."""


def _next_idle(
    queue: Iterator[tuple[OffloadKey, int]],
    blocks: dict[OffloadKey, BlockStatus],
    protected: Collection[OffloadKey],
    guarded: bool,
) -> tuple[OffloadKey, int] | None:
    """The next evictable (key, stamp) of a queue's walk, or None at its end. ``guarded``:
    whether ``protected`` holds any key at all (the manager passes none)."""
    for key, stamp in queue:
        if blocks[key].ref_cnt == 0 and not (guarded and key in protected):
            return key, stamp
    return None


class _TailStats:
    """Decaying counts of stored and later used blocks: store tails versus the rest."""

    __slots__ = ("_budget", "_period", "stored", "used")

    def __init__(self, period: int) -> None:
        self._period = period
        self._budget = period
        self.stored = [1.0, 1.0]  # [tails, others], with a prior of one use in one store
        self.used = [1.0, 1.0]

    def add_store(self, blocks: int) -> None:
        self.stored[0] += 1
        self.stored[1] += blocks - 1
        self._budget -= blocks
        if self._budget <= 0:
            self._budget = self._period
            self.stored = [x / 2 for x in self.stored]
            self.used = [x / 2 for x in self.used]

    def add_use(self, tail: bool) -> None:
        self.used[0 if tail else 1] += 1

    def tails_are_dead(self, ratio: float) -> bool:
        tail_rate = self.used[0] / self.stored[0]
        other_rate = self.used[1] / self.stored[1]
        return tail_rate < ratio * other_rate


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class AdaptiveLRUCachePolicy(QueuePolicy):
    """Age-weighted probation + LRU, weight from miniature simulations (see module doc)."""

    name = "alru"
    queue_attributes = ("_probation", "_main", "_ghost", "_main_ghost", "_tails")
    prefix_order = True
    weights: ClassVar[tuple[float, ...]] = (1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
    shadow_blocks: ClassVar[int] = 256
    """Size of each weight's miniature (the sampling rate is this over the capacity). 512
    until the lab's seventh round: twice the sampled keys above 512 blocks, and no better
    hit rates in the lab (``docs/policy-lab.md``)."""
    dead_tail_ratio: ClassVar[float] = 0.25
    """Demote store tails when they are used less than this fraction as often as the rest."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        # key -> stamp: insertion time on probation, last use in main.
        self._probation: OrderedDict[OffloadKey, int] = OrderedDict()
        self._main: OrderedDict[OffloadKey, int] = OrderedDict()
        self._ghost = GhostList(cache_capacity)
        self._main_ghost = GhostList(cache_capacity)
        # Store tails still on probation (a dict used as an ordered set).
        self._tails: dict[OffloadKey, None] = {}
        self._dead_tail_ratio = self.dead_tail_ratio  # read once (a lookup when compiled)
        self._now = 0
        self._feeds_duel = True
        self._reset_learning()

    def _learned_state(self) -> dict[str, object]:
        return {
            "weight": self._duel.weight,
            "demote_tails": self._demote_tails,
            "shadow_blocks": max(self._duel.sizes()),
        }

    def _reset_learning(self) -> None:
        self._now = 0
        self._duel = self._new_duel()
        self._feeds_duel = True
        self._tail_stats = _TailStats(period=4 * max(self.cache_capacity, 64))
        self._demote_tails = False

    def _new_duel(self) -> WeightDuel:
        return WeightDuel(self.cache_capacity, self.weights, shadow_blocks=self.shadow_blocks)

    def follow(self, leader: AdaptiveLRUCachePolicy) -> None:
        """Use ``leader``'s weight from now on and stop running miniatures of one's own
        (``leader`` keeps feeding its own, on its own traffic)."""
        self._duel = leader._duel
        self._feeds_duel = False

    def lead(self) -> None:
        """Run miniatures of one's own again after :meth:`follow` (afresh: weight 1)."""
        if not self._feeds_duel:
            self._duel = self._new_duel()
            self._feeds_duel = True

    # -- storage -------------------------------------------------------------------------

    def _enqueue(self, key: OffloadKey, block: BlockStatus) -> None:
        self._now += 1
        if self._ghost.recall(key) or self._main_ghost.recall(key):
            self._main[key] = self._now
        else:
            self._probation[key] = self._now

    def _flush_batch(self) -> None:
        batch = self._batch
        if not batch:
            return
        # The store covers the request from its first miss to its end: its last key is the
        # request's last block.
        tail = batch[-1]
        stats = self._tail_stats
        stats.add_store(len(batch))
        super()._flush_batch()
        if tail in self._probation:
            self._tails[tail] = None
            self._demote_tails = stats.tails_are_dead(self._dead_tail_ratio)
            if self._demote_tails:
                self._probation[tail] = _DEMOTED
                self._probation.move_to_end(tail, last=False)

    # -- use -----------------------------------------------------------------------------

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        blocks, probation, main = self._blocks, self._probation, self._main
        # The touch right after a store (its keys still being written), as vLLM and the
        # lab's driver make it.
        batch = self._batch
        last = blocks.get(batch[-1]) if batch else None
        after_store = last is not None and last.ref_cnt == -1
        self._flush_batch()
        if self._feeds_duel and not after_store:
            # The miniature caches see the request's sampled keys, except stores just
            # prepared; the touch after a store only repeats the hit prefix.
            duel = self._duel
            sampled = duel.sample(keys, blocks)
            if sampled:
                duel.access(sampled)
        now, tails = self._now, self._tails  # the clock in a local, stored back at the end
        for key in reversed(keys):
            block = blocks.get(key)
            if block is None:
                continue
            if block.ref_cnt == -1:
                # A store just prepared is not an access: refresh its recency only (a
                # demoted tail stays demoted).
                if probation.get(key, _DEMOTED) != _DEMOTED:
                    now += 1
                    probation[key] = now
                    probation.move_to_end(key)
                continue
            now += 1
            if key in main:
                main[key] = now
                main.move_to_end(key)
            else:
                del probation[key]
                main[key] = now
                tail = key in tails
                if tail:
                    del tails[key]
                self._tail_stats.add_use(tail)
        self._now = now

    # -- eviction ------------------------------------------------------------------------

    def _select(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        # Plain iterators and a function, not generators: cheaper when compiled.
        blocks = self._blocks
        guarded = len(protected) > 0
        on_probation = iter(self._probation.items())
        in_main = iter(self._main.items())
        p = _next_idle(on_probation, blocks, protected, guarded)
        m = _next_idle(in_main, blocks, protected, guarded)
        # (key, came from probation), in the order chosen: victims are returned in that order.
        selected: list[tuple[OffloadKey, bool]] = []
        now, weight = self._now, self._duel.weight
        for _ in range(n):
            if p is not None and (m is None or (now - p[1]) * weight >= now - m[1]):
                selected.append((p[0], True))
                p = _next_idle(on_probation, blocks, protected, guarded)
            elif m is not None:
                selected.append((m[0], False))
                m = _next_idle(in_main, blocks, protected, guarded)
            else:
                return None
        tails = self._tails
        ghost, main_ghost = self._ghost, self._main_ghost
        victims = []
        for key, on_probation_queue in selected:
            if on_probation_queue:
                del self._probation[key]
                if key in tails:
                    del tails[key]
                ghost.remember(key)
            else:
                del self._main[key]
                main_ghost.remember(key)
            block = blocks[key]  # get and del: compiled, ``dict.pop`` is a generic method call
            del blocks[key]
            victims.append((key, block))
        return victims
