"""One miniature copy of the adaptive LRU, fed a sample of the keys (``_mini_sim.py``).

A copy keeps each sampled key's state in lists indexed by a small id (:class:`KeyIds`,
shared by every copy), and its queues and ghosts as logs of ids with stamps; the Python
fallback of the ``_native_duel`` extension, decision for decision.
"""

from __future__ import annotations

from typing import Final, cast, final

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["KeyIds", "MiniCache"]

# Where a key is in one copy (its ``state``): nowhere, a queue, or a queue's ghosts.
_ABSENT: Final = 0
_PROBATION: Final = 1
_MAIN: Final = 2
_GHOST: Final = 3
_MAIN_GHOST: Final = 4


@final
class KeyIds:
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
        self.caches: list[MiniCache] = []

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
    boxed objects of :class:`KeyIds`. An entry is live while its id is still in this queue
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
class MiniCache:
    """The adaptive LRU in miniature, without pinning: new keys on probation, reused ones
    and recently evicted ones (ghosts, at most ``capacity`` per queue) in main.

    Evicts the probation head if its age times ``weight`` is at least the main head's age,
    else the main head (``weight`` 1 is plain LRU; larger weights drop unused keys sooner).
    Keys are :class:`KeyIds` ids; ``state`` is indexed by id, the stamps (access times)
    are the shared ones of :attr:`KeyIds.last`.
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

    def __init__(self, weight: float, capacity: int, ids: KeyIds) -> None:
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
        its last access in :attr:`KeyIds.last`); True on a hit, else it is stored
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
