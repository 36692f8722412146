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

import zlib
from collections.abc import Sequence
from typing import ClassVar, Final

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._alru_log import (
    DEMOTED_TAIL,
    MAIN,
    MAIN_GHOSTS,
    NOWHERE,
    PROBATION,
    PROBATION_GHOSTS,
    STAMP_SHIFT,
    TAIL,
    TOKEN_BITS,
    TOKEN_MASK,
    BlockLog,
    mark_of,
)
from kvcache_offload.control.policies._alru_tails import TailStats
from kvcache_offload.control.policies._alru_victims import select_victims
from kvcache_offload.control.policies._ghosts import GhostPair
from kvcache_offload.control.policies._mini_sim import HASH_SPACE as _HASH_SPACE
from kvcache_offload.control.policies._mini_sim import WeightDuel
from kvcache_offload.control.policies._prefix_batch import QueuePolicy
from kvcache_offload.control.policies.base import Blocks, BlockStatus, Keys, Protected
from kvcache_offload.errors import ConfigError

__all__ = ["AdaptiveLRUCachePolicy"]

_crc32: Final = zlib.crc32
"""Bound once: compiled, ``zlib.crc32`` in a function is a module attribute lookup per call."""


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class AdaptiveLRUCachePolicy(QueuePolicy):
    """Age-weighted probation + LRU, weight from miniature simulations (see module doc)."""

    name = "alru"
    queue_attributes = ()  # its own ``remove``, ``clear`` and ``debug_state`` name them
    prefix_order = True
    weights: ClassVar[tuple[float, ...]] = (1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
    shadow_blocks: ClassVar[int] = 256
    """Size of each weight's miniature (the sampling rate is this over the capacity). 512
    sampled twice the keys above 512 blocks for no better hit rates in the lab
    (``docs/policy-lab.md``)."""
    dead_tail_ratio: ClassVar[float] = 0.25
    """Demote store tails when they are used less than this fraction as often as the rest."""
    stamp_span: ClassVar[int] = 1 << 30
    """Clock ticks between two :meth:`_rebase` calls (small in tests)."""
    log_tokens: ClassVar[int] = TOKEN_MASK
    """The largest token of a log entry before the log is renumbered (small in tests)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        if cache_capacity > 1 << (TOKEN_BITS - 2):
            # Each live log entry has a token of its own in the mark's token bits, and a
            # compaction renumbers them from 0 once the tokens reach those bits' limit.
            raise ConfigError(
                f"the alru policy (which the default adaptive policy runs too) holds at most "
                f"{1 << (TOKEN_BITS - 2)} blocks, not {cache_capacity}: use larger blocks "
                f"or another eviction_policy (lru, arc, ...)"
            )
        # Stamps: insertion time on probation, last use in main.
        tokens = self.log_tokens
        self._probation = BlockLog(PROBATION, tokens)
        self._demoted = BlockLog(DEMOTED_TAIL, tokens)  # the front of probation, newest first
        self._main = BlockLog(MAIN, tokens)
        self._stamp_span = self.stamp_span
        self._next_rebase = self._stamp_span
        # The keys evicted from probation (list 0) and from main (1), ``capacity`` of each.
        self._ghosts = GhostPair(cache_capacity)
        self._tails = 0  # store tails still on probation (marked ``TAIL``)
        self._dead_tail_ratio = self.dead_tail_ratio  # read once (a lookup when compiled)
        self._now = 0
        self._feeds_duel = True
        # The adaptive policy's race sample, drawn with the duel's (:meth:`share_hash`).
        self._race_threshold = -1
        self.race_keys: list[OffloadKey] = []
        self.race_source: Sequence[OffloadKey] | None = None
        self._reset_learning()

    def _learned_state(self) -> dict[str, object]:
        return {
            "weight": self._duel.weight,
            "demote_tails": self._demote_tails,
            "shadow_blocks": max(self._duel.sizes()),
        }

    def _reset_learning(self) -> None:
        self._now = 0
        self._next_rebase = self._stamp_span
        self._duel = self._new_duel()
        self._feeds_duel = True
        self._tail_stats = TailStats(period=4 * max(self.cache_capacity, 64))
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

    def share_hash(self, threshold: int) -> None:
        """Also draw, with the CRC each :meth:`touch` computes for the duel, the keys whose
        CRC's high 16 bits are below ``threshold``: :attr:`race_keys`, for the keys
        :attr:`race_source` (None when the last touch hashed nothing)."""
        self._race_threshold = threshold

    def adopt_table(self, table: dict[OffloadKey, BlockStatus]) -> None:
        """Keep the blocks in ``table`` (holding exactly this policy's blocks) from now on:
        the adaptive policy's block table, so that a store or an eviction updates one dict,
        not two."""
        self._blocks = table

    # -- storage -------------------------------------------------------------------------

    def _enqueue(self, key: OffloadKey, block: BlockStatus) -> None:
        block.key_crc = -1  # a new key for this block (see ``touch``)
        self._now += 1
        now = self._now
        if self._ghosts.recall(key) >= 0:
            self._main.size += 1
            self._main.push(key, block, mark_of(now, MAIN))
        else:
            self._probation.size += 1
            self._probation.push(key, block, mark_of(now, PROBATION))
        if now >= self._next_rebase:
            self._rebase()

    def _flush_batch(self) -> None:
        batch = self._batch
        if not batch:
            return
        # The store covers the request from its first miss to its end: its last key is the
        # request's last block.
        stats = self._tail_stats
        stats.add_store(len(batch))
        # Each batched key's block as inserted: every call that could drop a key (``remove``,
        # ``evict``) flushes first, so no table probe is needed to find it.
        batch_blocks = self._batch_blocks
        probation, main = self._probation, self._main
        ghosts = self._ghosts
        now = self._now
        for index in range(len(batch) - 1, -1, -1):
            # :meth:`_enqueue`, inline (and :func:`mark_of`: a call per key when compiled).
            key = batch[index]
            block = batch_blocks[index]
            block.key_crc = -1  # a new key for this block (see ``touch``)
            now += 1
            if ghosts.recall(key) >= 0:
                main.size += 1
                main.push(key, block, (now << STAMP_SHIFT) | MAIN)
            else:
                probation.size += 1
                probation.push(key, block, (now << STAMP_SHIFT) | PROBATION)
        self._now = now
        if now >= self._next_rebase:
            self._rebase()
        tail_key = batch[-1]
        tail = batch_blocks[-1]
        batch.clear()
        batch_blocks.clear()
        if (tail.mark & 3) == PROBATION:
            self._tails += 1
            self._demote_tails = stats.tails_are_dead(self._dead_tail_ratio)
            if self._demote_tails:
                # To the front of probation: its entry there goes dead, the stamp stays.
                self._probation.size -= 1
                self._demoted.size += 1
                stamp = tail.mark >> STAMP_SHIFT
                self._demoted.pop_dead()
                self._demoted.push(tail_key, tail, mark_of(stamp, DEMOTED_TAIL) | TAIL)
            else:
                tail.mark |= TAIL

    def remove(self, key: OffloadKey) -> None:
        # A store failed: the key is live, so it sits in none of the ghost lists.
        self._flush_batch()
        block = self._blocks[key]
        del self._blocks[key]
        self._leave(block)

    def _leave(self, block: BlockStatus) -> None:
        """Take ``block`` out of its queue (its log entry goes dead)."""
        mark = block.mark
        where = mark & 3
        if where == MAIN:
            self._main.size -= 1
        elif where == PROBATION:
            self._probation.size -= 1
        elif where == DEMOTED_TAIL:
            self._demoted.size -= 1
        if mark & TAIL:
            self._tails -= 1
        block.mark = NOWHERE

    def clear(self) -> None:
        self._probation.clear()
        self._demoted.clear()
        self._main.clear()
        self._ghosts.clear()
        self._tails = 0
        super().clear()

    def debug_state(self) -> dict[str, object]:
        self._flush_batch()
        state: dict[str, object] = {
            "size": len(self),
            "probation": self._probation.size + self._demoted.size,
            "main": self._main.size,
            "ghost": self._ghosts.size(PROBATION_GHOSTS),
            "main_ghost": self._ghosts.size(MAIN_GHOSTS),
            "tails": self._tails,
        }
        state.update(self._learned_state())
        return state

    # -- use -----------------------------------------------------------------------------

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        blocks = self._blocks
        # The touch right after a store (its keys still being written), as vLLM and the
        # lab's driver make it.
        batch_blocks = self._batch_blocks
        after_store = len(batch_blocks) > 0 and batch_blocks[-1].ref_cnt == -1
        self._flush_batch()
        self.race_source = None
        # The miniature caches see the request's sampled keys, except stores just
        # prepared; the touch after a store only repeats the hit prefix. The sample is
        # drawn in the same walk as the use (one table lookup per key), tail first, and
        # put back in prefix order before the copies see it; a stored block keeps its
        # key's CRC (:attr:`BlockStatus.key_crc`), so a hit is hashed only once.
        sampling = self._feeds_duel and not after_store
        duel = self._duel
        own = duel.threshold if sampling else 0
        race = self._race_threshold if sampling else -1
        hashing = race >= 0 or own < _HASH_SPACE
        sampled: list[OffloadKey] = []
        race_keys: list[OffloadKey] = []
        # A list (the manager's argument) is walked by index: ``reversed`` of a sequence
        # costs a builtins lookup per call and a generic iterator step per key.
        key_list = keys if isinstance(keys, list) else list(keys)
        probation, main = self._probation, self._main
        now = self._now  # the clock in a local, stored back at the end
        for position in range(len(key_list) - 1, -1, -1):
            key = key_list[position]
            block = blocks.get(key)
            if sampling:
                if hashing:
                    if block is None:
                        value = _crc32(key)
                    else:
                        value = block.key_crc
                        if value < 0:
                            value = _crc32(key)
                            block.key_crc = value
                    if (value & 0xFFFF) < own and (block is None or block.ref_cnt != -1):
                        sampled.append(key)
                    if (value >> 16) < race:
                        race_keys.append(key)
                elif block is None or block.ref_cnt != -1:
                    sampled.append(key)
            if block is None:
                continue
            mark = block.mark
            where = mark & 3
            if block.ref_cnt == -1:
                # A store just prepared is not an access: refresh its recency only (a
                # demoted tail stays demoted, a block in main stays put).
                if where == PROBATION:
                    now += 1
                    probation.push(key, block, (now << STAMP_SHIFT) | (mark & (TAIL | 3)))
                continue
            now += 1
            main.push(key, block, (now << STAMP_SHIFT) | MAIN)
            if where != MAIN:
                if where == PROBATION:
                    probation.size -= 1
                else:
                    self._demoted.size -= 1
                main.size += 1
                tail = (mark & TAIL) != 0
                if tail:
                    self._tails -= 1
                self._tail_stats.add_use(tail)
        if race >= 0:
            race_keys.reverse()
            self.race_keys = race_keys
            self.race_source = keys
        if sampled:
            # The copies' state is their own: using them after the queues changes nothing.
            sampled.reverse()
            duel.access(sampled)
        self._now = now
        if now >= self._next_rebase:
            self._rebase()

    # -- eviction ------------------------------------------------------------------------

    def _select_blocks(self, n: int, protected: Protected, keys: Keys, blocks: Blocks) -> bool:
        return select_victims(self, n, protected, keys, blocks)

    def _rebase(self) -> None:
        """Subtract the oldest live stamp from every stamp and from the clock: the ages,
        all that eviction reads, stay the same, and the stamps stay native ints (with the
        token in the mark, a stamp of 2^32 or more would make every mark a boxed int)."""
        self._trim_heads()
        offset = self._now
        for log in (self._probation, self._main, self._demoted):
            for index in range(log.head, len(log.keys)):
                if log.live(index):
                    offset = min(offset, log.blocks[index].mark >> STAMP_SHIFT)
        if offset > 0:
            for log in (self._probation, self._main, self._demoted):
                log.rebase(offset)
            self._now -= offset
        self._next_rebase = self._now + self._stamp_span

    def _trim_heads(self) -> None:
        """Drop the dead entries at the head of each log and the end of the stack."""
        self._probation.skip_dead()
        self._main.skip_dead()
        self._demoted.pop_dead()
