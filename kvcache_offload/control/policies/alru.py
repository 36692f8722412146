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

The queues are logs (:class:`_BlockLog`) whose entries hold the block itself, and a block's
queue, stamp, tail flag and the token of its live log entry live in its ``mark``
(:func:`_mark`): a use reads and writes the block in hand and appends to two lists, where
ordered dicts of stamps cost a hash probe per queue, a boxed stamp and a ``move_to_end``
method call (the lab's eighth round), and a list of stamps a boxed int per use (ninth).
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Sequence
from typing import ClassVar, Final, final

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._ghosts import GhostPair
from kvcache_offload.control.policies._mini_sim import HASH_SPACE as _HASH_SPACE
from kvcache_offload.control.policies._mini_sim import WeightDuel
from kvcache_offload.control.policies._prefix_batch import QueuePolicy
from kvcache_offload.control.policies.base import BlockStatus
from kvcache_offload.errors import ConfigError

__all__ = ["AdaptiveLRUCachePolicy"]

_crc32: Final = zlib.crc32
"""Bound once: compiled, ``zlib.crc32`` in a function is a module attribute lookup per call."""

_DEMOTED: Final = -(1 << 62)
"""Age stamp of a demoted block: older than anything, so it is the first to go."""

# Where a block is (the low two bits of its mark): no queue, probation, demoted (the front
# of probation), main.
_NOWHERE: Final = 0
_PROBATION: Final = 1
_DEMOTED_TAIL: Final = 2
_MAIN: Final = 3
_TAIL: Final = 4
"""Mark bit of a store tail still on probation."""
_PROBATION_GHOSTS: Final = 0
_MAIN_GHOSTS: Final = 1
"""The two lists of the ghost pair: keys evicted from probation, from main."""
_TOKEN_SHIFT: Final = 3
_TOKEN_BITS: Final = 27
_TOKEN_MASK: Final = (1 << _TOKEN_BITS) - 1
_STAMP_SHIFT: Final = _TOKEN_SHIFT + _TOKEN_BITS


def _mark(stamp: int, where: int) -> int:
    """A block's mark less its token (set by :meth:`_BlockLog.push`): its stamp (the time of
    its last enqueue or use), its queue and no tail flag. Layout: stamp, token (the position
    of its live log entry), tail flag, queue; native while the stamp is below 2^32
    (:meth:`AdaptiveLRUCachePolicy._rebase`)."""
    return (stamp << _STAMP_SHIFT) | where


@final
class _BlockLog:
    """One queue in order: (key, block) entries from ``head`` on, oldest first (the demoted
    stack: newest first, read from the end). An entry is live while its block's mark holds
    this queue and the entry's token, ``base`` plus its index; a block that moved on or left
    leaves a dead entry, skipped by walks and dropped when the head passes it or dead
    entries outnumber live ones four to one (:meth:`compact`, which renumbers the live ones).
    No stamp list: the stamp is in the mark too, so a push appends two references and boxes
    nothing (the lab's ninth round)."""

    __slots__ = ("base", "blocks", "head", "keys", "size", "token_limit", "where")

    def __init__(self, where: int, token_limit: int = _TOKEN_MASK) -> None:
        self.where = where
        self.keys: list[OffloadKey] = []
        self.blocks: list[BlockStatus] = []
        self.head = 0
        self.base = 0  # the token of index 0 (entries dropped from the front since renumbering)
        self.size = 0  # live entries
        self.token_limit = token_limit

    def push(self, key: OffloadKey, block: BlockStatus, mark: int) -> None:
        """Append ``block``, marked ``mark`` (no token) plus its entry's token."""
        keys = self.keys
        token = self.base + len(keys)
        block.mark = mark | (token << _TOKEN_SHIFT)
        keys.append(key)
        self.blocks.append(block)
        # Dead entries may outnumber live ones four to one before a compaction: at two to one
        # (until the fourteenth session) compactions took 134 M of the 1,833 M manager
        # instructions at 2 % of the conversation trace; at four, 75 M fewer in all, at eight
        # no fewer again (longer walks past dead entries).
        if len(keys) - self.head > 4 * self.size + 64 or token >= self.token_limit:
            self.compact()

    def live(self, index: int) -> bool:
        mark = self.blocks[index].mark
        return (mark & 3) == self.where and (
            (mark >> _TOKEN_SHIFT) & _TOKEN_MASK
        ) == self.base + index

    def compact(self) -> None:
        """The log less its dead entries, in the same order, renumbered from 0."""
        keys: list[OffloadKey] = []
        blocks: list[BlockStatus] = []
        for index in range(self.head, len(self.keys)):
            if self.live(index):
                block = self.blocks[index]
                mark = block.mark
                block.mark = (mark & ~(_TOKEN_MASK << _TOKEN_SHIFT)) | (len(keys) << _TOKEN_SHIFT)
                keys.append(self.keys[index])
                blocks.append(block)
        self.keys, self.blocks = keys, blocks
        self.head = 0
        self.base = 0

    def skip_dead(self) -> None:
        """Move the head past the dead entries there (every push leaves one behind)."""
        blocks, where = self.blocks, self.where
        head, end = self.head, len(blocks)
        token = self.base + head
        while head < end:
            mark = blocks[head].mark
            if (mark & 3) == where and ((mark >> _TOKEN_SHIFT) & _TOKEN_MASK) == token:
                break
            head += 1
            token += 1
        self.trim(head)

    def pop_dead(self) -> None:
        """Drop the dead entries at the end (the demoted stack's top): before a push, or
        the victims just taken from the top would be buried under it and walked past by
        every later eviction."""
        keys, blocks = self.keys, self.blocks
        while keys and not self.live(len(keys) - 1):
            keys.pop()
            blocks.pop()

    def trim(self, head: int) -> None:
        """Move the head to ``head`` (every entry before it dead)."""
        if head > 64 and 2 * head > len(self.keys):
            del self.keys[:head]
            del self.blocks[:head]
            self.base += head
            head = 0
        self.head = head

    def rebase(self, offset: int) -> None:
        """Subtract ``offset`` from the stamp of every live entry's block."""
        shifted = offset << _STAMP_SHIFT
        for index in range(self.head, len(self.keys)):
            if self.live(index):
                block = self.blocks[index]
                block.mark = block.mark - shifted

    def clear(self) -> None:
        self.keys.clear()
        self.blocks.clear()
        self.head = 0
        self.base = 0
        self.size = 0

    def __len__(self) -> int:
        return self.size


@final
class _TailStats:
    """Decaying counts of stored and later used blocks: store tails versus the rest.

    Four float attributes, not two lists: compiled, each is a native double, where an item of
    a list of floats is a float object allocated anew on every count."""

    __slots__ = ("_budget", "_period", "stored_other", "stored_tails", "used_other", "used_tails")

    def __init__(self, period: int) -> None:
        self._period = period
        self._budget = period
        # A prior of one use in one store, for tails and for the others.
        self.stored_tails = 1.0
        self.stored_other = 1.0
        self.used_tails = 1.0
        self.used_other = 1.0

    def add_store(self, blocks: int) -> None:
        self.stored_tails += 1
        self.stored_other += blocks - 1
        self._budget -= blocks
        if self._budget <= 0:
            self._budget = self._period
            self.stored_tails /= 2
            self.stored_other /= 2
            self.used_tails /= 2
            self.used_other /= 2

    def add_use(self, tail: bool) -> None:
        if tail:
            self.used_tails += 1
        else:
            self.used_other += 1

    def tails_are_dead(self, ratio: float) -> bool:
        tail_rate = self.used_tails / self.stored_tails
        other_rate = self.used_other / self.stored_other
        return tail_rate < ratio * other_rate


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class AdaptiveLRUCachePolicy(QueuePolicy):
    """Age-weighted probation + LRU, weight from miniature simulations (see module doc)."""

    name = "alru"
    queue_attributes = ()  # its own ``remove``, ``clear`` and ``debug_state`` name them
    prefix_order = True
    weights: ClassVar[tuple[float, ...]] = (1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
    shadow_blocks: ClassVar[int] = 256
    """Size of each weight's miniature (the sampling rate is this over the capacity). 512
    until the lab's seventh round: twice the sampled keys above 512 blocks, and no better
    hit rates in the lab (``docs/policy-lab.md``)."""
    dead_tail_ratio: ClassVar[float] = 0.25
    """Demote store tails when they are used less than this fraction as often as the rest."""
    stamp_span: ClassVar[int] = 1 << 30
    """Clock ticks between two :meth:`_rebase` calls (small in tests)."""
    log_tokens: ClassVar[int] = _TOKEN_MASK
    """The largest token of a log entry before the log is renumbered (small in tests)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        if cache_capacity > 1 << (_TOKEN_BITS - 2):
            # Each live log entry has a token of its own in the mark's token bits, and a
            # compaction renumbers them from 0 once the tokens reach those bits' limit.
            raise ConfigError(
                f"the alru policy (which the default adaptive policy runs too) holds at most "
                f"{1 << (_TOKEN_BITS - 2)} blocks, not {cache_capacity}: use larger blocks "
                f"or another eviction_policy (lru, arc, ...)"
            )
        # Stamps: insertion time on probation, last use in main.
        tokens = self.log_tokens
        self._probation = _BlockLog(_PROBATION, tokens)
        self._demoted = _BlockLog(_DEMOTED_TAIL, tokens)  # the front of probation, newest first
        self._main = _BlockLog(_MAIN, tokens)
        self._stamp_span = self.stamp_span
        self._next_rebase = self._stamp_span
        # The keys evicted from probation (list 0) and from main (1), ``capacity`` of each.
        self._ghosts = GhostPair(cache_capacity)
        self._tails = 0  # store tails still on probation (marked ``_TAIL``)
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
            self._main.push(key, block, _mark(now, _MAIN))
        else:
            self._probation.size += 1
            self._probation.push(key, block, _mark(now, _PROBATION))
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
            # :meth:`_enqueue`, inline (and :func:`_mark`: a call per key when compiled).
            key = batch[index]
            block = batch_blocks[index]
            block.key_crc = -1  # a new key for this block (see ``touch``)
            now += 1
            if ghosts.recall(key) >= 0:
                main.size += 1
                main.push(key, block, (now << _STAMP_SHIFT) | _MAIN)
            else:
                probation.size += 1
                probation.push(key, block, (now << _STAMP_SHIFT) | _PROBATION)
        self._now = now
        if now >= self._next_rebase:
            self._rebase()
        tail_key = batch[-1]
        tail = batch_blocks[-1]
        batch.clear()
        batch_blocks.clear()
        if (tail.mark & 3) == _PROBATION:
            self._tails += 1
            self._demote_tails = stats.tails_are_dead(self._dead_tail_ratio)
            if self._demote_tails:
                # To the front of probation: its entry there goes dead, the stamp stays.
                self._probation.size -= 1
                self._demoted.size += 1
                stamp = tail.mark >> _STAMP_SHIFT
                self._demoted.pop_dead()
                self._demoted.push(tail_key, tail, _mark(stamp, _DEMOTED_TAIL) | _TAIL)
            else:
                tail.mark |= _TAIL

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
        if where == _MAIN:
            self._main.size -= 1
        elif where == _PROBATION:
            self._probation.size -= 1
        elif where == _DEMOTED_TAIL:
            self._demoted.size -= 1
        if mark & _TAIL:
            self._tails -= 1
        block.mark = _NOWHERE

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
            "ghost": self._ghosts.size(_PROBATION_GHOSTS),
            "main_ghost": self._ghosts.size(_MAIN_GHOSTS),
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
                if where == _PROBATION:
                    now += 1
                    probation.push(key, block, (now << _STAMP_SHIFT) | (mark & (_TAIL | 3)))
                continue
            now += 1
            main.push(key, block, (now << _STAMP_SHIFT) | _MAIN)
            if where != _MAIN:
                if where == _PROBATION:
                    probation.size -= 1
                else:
                    self._demoted.size -= 1
                main.size += 1
                tail = (mark & _TAIL) != 0
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

    def _select_blocks(
        self,
        n: int,
        protected: Collection[OffloadKey],
        keys: list[OffloadKey],
        blocks: list[BlockStatus],
    ) -> bool:
        # The victims go straight into the manager's two lists: no pair per victim.
        # Two walks (probation: the demoted stack from its end, then the log from its head;
        # main: its log) merged by age; the victims are taken out only once there are ``n``.
        guarded = len(protected) > 0  # the manager passes none: skip the membership tests
        probation, demoted, main = self._probation, self._demoted, self._main
        self._trim_heads()
        # Probation cursor: an index into the demoted stack (walked down) while ``in_stack``,
        # then into the probation log (walked up); -1: that walk is over.
        in_stack = True
        p = self._next_demoted(len(demoted.keys) - 1, protected, guarded)
        if p < 0:
            in_stack = False
            p = self._next_idle(probation, probation.head, protected, guarded)
        m = self._next_idle(main, main.head, protected, guarded)
        # Victims in the order chosen, appended to the two lists as found: the keys and
        # blocks of the logs' entries (no index boxed per victim); each block's mark still
        # says where it is. Taken back out if there are fewer than ``n``.
        start = len(keys)
        start_blocks = len(blocks)  # the caller's lists need not be the same length
        now, weight = self._now, self._duel.weight
        # A demoted block's weighted age, once: its stamp is beyond a native int, so the
        # arithmetic would allocate on every comparison (the same float either way).
        demoted_age = (now - _DEMOTED) * weight
        for _victim in range(n):  # not ``_``: compiled, an int object per step
            if p >= 0:
                p_age = (
                    demoted_age
                    if in_stack
                    else (now - (probation.blocks[p].mark >> _STAMP_SHIFT)) * weight
                )
                if m < 0 or p_age >= now - (main.blocks[m].mark >> _STAMP_SHIFT):
                    if in_stack:
                        keys.append(demoted.keys[p])
                        blocks.append(demoted.blocks[p])
                        p = self._next_demoted(p - 1, protected, guarded)
                        if p < 0:
                            in_stack = False
                            p = self._next_idle(probation, probation.head, protected, guarded)
                    else:
                        keys.append(probation.keys[p])
                        blocks.append(probation.blocks[p])
                        p = self._next_idle(probation, p + 1, protected, guarded)
                    continue
            if m >= 0:
                keys.append(main.keys[m])
                blocks.append(main.blocks[m])
                m = self._next_idle(main, m + 1, protected, guarded)
            else:
                del keys[start:]
                del blocks[start_blocks:]
                return False
        table = self._blocks
        ghosts = self._ghosts
        from_main = from_probation = from_stack = tails = 0
        for i in range(n):
            key = keys[start + i]
            block = blocks[start_blocks + i]
            mark = block.mark
            where = mark & 3
            if where == _MAIN:
                ghosts.remember(key, _MAIN_GHOSTS)
                from_main += 1
            else:
                ghosts.remember(key, _PROBATION_GHOSTS)
                if where == _PROBATION:
                    from_probation += 1
                else:
                    from_stack += 1
                if mark & _TAIL:
                    tails += 1
            block.mark = _NOWHERE
            del table[key]
        main.size -= from_main
        probation.size -= from_probation
        demoted.size -= from_stack
        self._tails -= tails
        return True

    def _rebase(self) -> None:
        """Subtract the oldest live stamp from every stamp and from the clock: the ages,
        all that eviction reads, stay the same, and the stamps stay native ints (with the
        token in the mark, a stamp of 2^32 or more would make every mark a boxed int)."""
        self._trim_heads()
        offset = self._now
        for log in (self._probation, self._main, self._demoted):
            for index in range(log.head, len(log.keys)):
                if log.live(index):
                    offset = min(offset, log.blocks[index].mark >> _STAMP_SHIFT)
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

    @staticmethod
    def _next_idle(
        log: _BlockLog, index: int, protected: Collection[OffloadKey], guarded: bool
    ) -> int:
        """The index of the first live, evictable entry of ``log`` from ``index`` on, or -1."""
        blocks, keys, where = log.blocks, log.keys, log.where
        end = len(keys)
        base = log.base
        while index < end:
            block = blocks[index]
            mark = block.mark
            if (
                (mark & 3) == where
                and ((mark >> _TOKEN_SHIFT) & _TOKEN_MASK) == base + index
                and block.ref_cnt == 0
                and not (guarded and keys[index] in protected)
            ):
                return index
            index += 1
        return -1

    def _next_demoted(self, index: int, protected: Collection[OffloadKey], guarded: bool) -> int:
        """The index of the next live, evictable entry of the demoted stack from ``index``
        down, or -1."""
        log = self._demoted
        blocks, keys = log.blocks, log.keys
        base = log.base
        while index >= 0:
            block = blocks[index]
            mark = block.mark
            if (
                (mark & 3) == _DEMOTED_TAIL
                and ((mark >> _TOKEN_SHIFT) & _TOKEN_MASK) == base + index
                and block.ref_cnt == 0
                and not (guarded and keys[index] in protected)
            ):
                return index
            index -= 1
        return -1
