"""Miniature simulations that pick the adaptive LRU's probation weight online.

Waldspurger et al. (ATC'17, "Cache modeling and optimization using miniature simulations"):
a cache fed a spatially hashed sample of the keys, scaled down by the sampling rate, shows
the hit ratio of the full-size cache. Here several small copies of the adaptive LRU run side
by side, one per candidate weight, on the same sample; the policy uses the weight whose copy
hits most, with exponentially decaying hit counts so it follows shifts in the workload.
Memory is bounded: each copy holds at most ``rate x capacity`` keys (a few hundred) plus
as many ghost keys per queue, like the policy it models.

Where the C extension ``_native_duel`` is built, :class:`WeightDuel` runs the copies there
(the same simulation, decision for decision; ``tests/unit/test_alru_structures.py`` checks
both against a model): compiled with mypyc, a copy's step cost about 1,800 instructions per
sampled key, a fifth of the adaptive LRU's manager time at 1 % of the conversation trace
(``docs/policy-lab.md``, fifteenth round). The classes below are the fallback, and what
``KVCACHE_OFFLOAD_PURE_PYTHON=1`` runs.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, Final, cast, final

from kvcache_offload._compiled import pure_python_requested
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies.base import BlockStatus

try:
    from kvcache_offload.control.policies._native_duel import NativeDuel as _NativeDuel
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _NativeDuel = None

__all__ = ["WeightDuel"]

HASH_SPACE: Final = 1 << 16
"""A key is sampled when 16 bits of its CRC-32 are below ``rate x HASH_SPACE``."""
_HASH_SPACE: Final = HASH_SPACE

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
    the copies hold.

    Every copy sees every access, so the time of a key's last access is the same in all of
    them: it is kept once, in :attr:`last`, as the one boxed int per access that the copies'
    logs share (compiled, an int stored in a list is a new object each time; here each id and
    each access time is boxed once, and the logs only take references)."""

    __slots__ = ("_free", "_ids", "_keys", "boxed", "caches", "last", "refs")

    def __init__(self) -> None:
        self._ids: dict[OffloadKey, int] = {}
        self._keys: list[OffloadKey | None] = []
        self._free: list[int] = []
        self.refs: list[int] = []  # copies holding the id, plus requests using it
        self.boxed: list[object] = []  # ``boxed[i]`` is ``i``, what the logs hold
        self.last: list[object] = []  # the time of the id's last access (None: none yet)
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
                self.boxed.append(index)
                self.last.append(None)
                for cache in self.caches:
                    cache.state.append(_ABSENT)
            self._ids[key] = index
        refs = self.refs
        refs[index] = refs[index] + 1  # not ``+=``: compiled, that is a generic in-place add
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
    """One queue of a copy, oldest first: (id, stamp) entries from ``head`` on, both the
    boxed objects of :class:`_KeyIds`. An entry is live while its id is still in this queue
    (``state`` is ``tag``) and its stamp is still the id's last access (the same object in
    ``last``): a key moved on, dropped or used again leaves a dead entry behind (every
    access appends a new entry; a ghost keeps the stamp of the access before its
    eviction), skipped at the head and filtered out when dead entries outnumber live ones
    (the same order as an ordered dict, without a dict)."""

    __slots__ = ("head", "ids", "size", "stamps", "tag")

    def __init__(self, tag: int) -> None:
        self.tag = tag
        self.ids: list[object] = []
        self.stamps: list[object] = []
        self.head = 0
        self.size = 0  # live entries

    def append(self, boxed_id: object, stamp: object, state: list[int], last: list[object]) -> None:
        self.ids.append(boxed_id)
        self.stamps.append(stamp)
        if len(self.ids) - self.head > 2 * self.size + 64:
            self._compact(state, last)

    def oldest(self, state: list[int], last: list[object]) -> int:
        """The position of the oldest live entry, or -1 when the queue is empty."""
        if self.size == 0:
            return -1
        ids, stamps, tag = self.ids, self.stamps, self.tag
        head = self.head
        while True:
            index = cast(int, ids[head])
            if state[index] == tag and last[index] is stamps[head]:
                break
            head += 1
        if head > 64 and 2 * head > len(ids):
            del ids[:head]
            del stamps[:head]
            head = 0
        self.head = head
        return head

    def _compact(self, state: list[int], last: list[object]) -> None:
        ids, stamps, tag = self.ids, self.stamps, self.tag
        live_ids: list[object] = []
        live_stamps: list[object] = []
        for position in range(self.head, len(ids)):
            boxed_id = ids[position]
            index = cast(int, boxed_id)
            stamp = stamps[position]
            if state[index] == tag and last[index] is stamp:
                live_ids.append(boxed_id)
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
    Keys are :class:`_KeyIds` ids; ``state`` is indexed by id, the stamps (access times)
    are the shared ones of :attr:`_KeyIds.last`.
    """

    __slots__ = (
        "capacity",
        "ghost",
        "hits",
        "ids",
        "main",
        "main_ghost",
        "probation",
        "run",
        "state",
        "weight",
    )

    def __init__(self, weight: float, capacity: int, ids: _KeyIds) -> None:
        self.weight = weight
        self.capacity = capacity
        self.ids = ids
        self.state: list[int] = [_ABSENT] * len(ids.refs)
        self.probation = _Log(_PROBATION)
        self.main = _Log(_MAIN)
        self.ghost = _Log(_GHOST)
        self.main_ghost = _Log(_MAIN_GHOST)
        self.hits = 0.0
        self.run = 0  # hits since the last miss in the request being scored

    def access(self, index: int, boxed_id: object, now: int, stamp: object) -> bool:
        """Use the key of id ``index`` (``boxed_id``) at time ``now`` (``stamp``, already
        its last access in :attr:`_KeyIds.last`); True on a hit, else it is stored
        (evicting one key if full)."""
        state, last = self.state, self.ids.last
        main = self.main
        where = state[index]
        if where == _MAIN:
            main.append(boxed_id, stamp, state, last)
            return True
        if where == _PROBATION:
            self.probation.size -= 1
            state[index] = _MAIN
            main.size += 1
            main.append(boxed_id, stamp, state, last)
            return True
        probation = self.probation
        if where == _ABSENT:
            refs = self.ids.refs
            refs[index] = refs[index] + 1
            state[index] = _PROBATION
            probation.size += 1
            probation.append(boxed_id, stamp, state, last)
        else:  # a ghost of either queue: stored again soon after leaving
            if where == _GHOST:
                self.ghost.size -= 1
            else:
                self.main_ghost.size -= 1
            state[index] = _MAIN
            main.size += 1
            main.append(boxed_id, stamp, state, last)
        if probation.size + main.size <= self.capacity:
            return False
        oldest = probation.oldest(state, last)
        main_oldest = main.oldest(state, last)
        if oldest >= 0 and (
            main_oldest < 0
            or (now - cast(int, probation.stamps[oldest])) * self.weight
            >= now - cast(int, main.stamps[main_oldest])
        ):
            self._remember(probation, oldest, self.ghost)
        elif main_oldest >= 0:
            self._remember(main, main_oldest, self.main_ghost)
        return False

    def _remember(self, queue: _Log, position: int, ghosts: _Log) -> None:
        """Evict the entry at ``position`` (a queue's oldest) into ``ghosts``, forgetting
        the oldest ghost beyond ``capacity``."""
        state, last = self.state, self.ids.last
        boxed_id = queue.ids[position]
        index = cast(int, boxed_id)
        queue.size -= 1
        state[index] = ghosts.tag
        # Every entry up to ``position`` is dead now: the next :meth:`_Log.oldest` starts
        # past it instead of checking it again.
        queue.head = position + 1
        ghosts.size += 1
        ghosts.append(boxed_id, queue.stamps[position], state, last)
        if ghosts.size > self.capacity:
            oldest = ghosts.oldest(state, last)
            gone = cast(int, ghosts.ids[oldest])
            state[gone] = _ABSENT
            ghosts.head = oldest + 1
            ghosts.size -= 1
            self.ids.release(gone)

    def __len__(self) -> int:
        return self.probation.size + self.main.size


def native_duel_available() -> bool:
    """Whether the weight miniatures can run in C (the extension is built and the pure-Python
    switch is off)."""
    return _NativeDuel is not None and not pure_python_requested()


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
        native: bool | None = None,
    ) -> None:
        """``native``: run the copies in C (None: wherever :func:`native_duel_available`;
        True where it is not raises ``RuntimeError``)."""
        rate = min(1.0, max(shadow_blocks / max(cache_capacity, 1), min_rate))
        self.rate = rate
        self._threshold = max(1, round(rate * _HASH_SPACE))
        capacity = max(1, round(rate * cache_capacity))
        self._weights = [float(w) for w in weights]
        self._ids = _KeyIds()
        self._caches: list[_MiniCache] = []
        self._native: Any = None
        if native is None:
            native = native_duel_available()
        if native:
            if _NativeDuel is None:
                raise RuntimeError("the _native_duel extension is not built")
            self._native = _NativeDuel(capacity, self._weights, decay_every, initial_weight)
        else:
            self._caches = [_MiniCache(w, capacity, self._ids) for w in self._weights]
            self._ids.caches = self._caches
        self._decay_every = decay_every
        self._steps = 0
        self._now = 0  # accesses so far: the clock of every copy
        self.weight = initial_weight

    @property
    def native(self) -> bool:
        """Whether the copies run in C."""
        return self._native is not None

    @property
    def threshold(self) -> int:
        """A key is sampled when its CRC's low 16 bits are below this (every key when it
        is :data:`HASH_SPACE` or more)."""
        return self._threshold

    def sampled(self, key: OffloadKey) -> bool:
        """Whether ``key`` is in the sample (a deterministic hash, so replays repeat)."""
        return (zlib.crc32(key) & 0xFFFF) < self._threshold

    def sample(
        self, keys: Sequence[OffloadKey], blocks: dict[OffloadKey, BlockStatus]
    ) -> list[OffloadKey]:
        """The sampled ``keys`` in order, less those of ``blocks`` being written (a store
        just prepared is not an access): one loop instead of two calls per key."""
        threshold = self._threshold
        out: list[OffloadKey] = []
        if threshold >= _HASH_SPACE:
            # Every key (a cache of at most ``shadow_blocks``, such as the adaptive
            # policy's miniature of this policy): no hash needed.
            for key in keys:
                block = blocks.get(key)
                if block is None or block.ref_cnt != -1:
                    out.append(key)
            return out
        crc = zlib.crc32
        for key in keys:
            if (crc(key) & 0xFFFF) < threshold:
                block = blocks.get(key)
                if block is None or block.ref_cnt != -1:
                    out.append(key)
        return out

    def sample_with(
        self,
        keys: Sequence[OffloadKey],
        blocks: dict[OffloadKey, BlockStatus],
        threshold: int,
        out: list[OffloadKey],
    ) -> list[OffloadKey]:
        """:meth:`sample`, also appending to ``out`` the ``keys`` whose CRC's high 16 bits
        are below ``threshold`` (the adaptive policy's race samples on them): one CRC per
        key for both samples."""
        own = self._threshold
        crc = zlib.crc32
        sampled: list[OffloadKey] = []
        for key in keys:
            value = crc(key)
            if (value & 0xFFFF) < own:
                block = blocks.get(key)
                if block is None or block.ref_cnt != -1:
                    sampled.append(key)
            if (value >> 16) < threshold:
                out.append(key)
        return sampled

    def access(self, keys: Sequence[OffloadKey]) -> None:
        """The sampled keys of one request, in prefix order.

        Each copy uses them tail first (as ``touch`` does) and scores the hits up to its
        first miss in prefix order: past a miss the real lookup would stop too. Every
        ``decay_every`` sampled keys the weight is re-chosen.
        """
        native = self._native
        if native is not None:
            self.weight = native.access(keys)
            return
        table = self._ids
        boxed, last, caches = table.boxed, table.last, self._caches
        held: list[object] = [boxed[table.pin(key)] for key in keys]
        for cache in caches:
            cache.run = 0
        now = self._now
        for boxed_id in reversed(held):
            index = cast(int, boxed_id)
            now += 1
            stamp: object = now  # boxed once, shared by every copy's logs
            last[index] = stamp
            for cache in caches:
                # Hits since the last miss, tail first: the hits before the first miss in
                # prefix order.
                if cache.access(index, boxed_id, now, stamp):
                    cache.run += 1
                else:
                    cache.run = 0
        self._now = now
        for cache in caches:
            cache.hits += cache.run
        for boxed_id in held:
            table.release(cast(int, boxed_id))
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
        native = self._native
        if native is not None:
            return cast(list[int], native.sizes())
        return [len(c) for c in self._caches]

    def hit_counts(self) -> dict[float, float]:
        native = self._native
        if native is not None:
            return dict(zip(self._weights, cast(list[float], native.hits()), strict=True))
        return {c.weight: c.hits for c in self._caches}

    def id_slots(self) -> int:
        """Ids ever allocated to sampled keys (they are reused: bounded by what the copies
        hold)."""
        native = self._native
        if native is not None:
            return cast(int, native.id_slots())
        return len(self._ids.refs)
