"""Policy research harness: candidate eviction rules against LRU and Belady.

    python -m research.policy_candidates [--capacities 1%,2%,5%,10%,20%,3%,7%,15%] [--slices 2]

A candidate is tried here before it is written as a real ``CachePolicy``: this is a small
integer-key simulator of the replay driver's call sequence (lookup the prefix up to the first
miss, touch every key tail first, store the misses while the request's present keys are
protected, touch again; a store is not an access). Its ``lru`` column reproduces the policy
lab's LRU numbers exactly, which is the check that the harness follows the driver. For every
trace, capacity and slice (``--slices N`` also replays each N-th of the trace on its own, as
held-out traffic) it prints each candidate's block hit rate and the share of the
LRU -> Belady gap it closes (Belady = MIN with bypass, ``kvcache_offload.lab.belady``).

The candidates, written from their published descriptions:

* ``wtinylfu``: W-TinyLFU (Einziger, Friedman, Manes, ToS 2017): a 1 % LRU window, an SLRU
  main (20 % probation, 80 % protected), a count-min sketch (4 rows of counters saturating at
  15, halved every 10 x capacity additions) behind a doorkeeper set; a window victim enters
  main only if the sketch counts it more often than main's victim. The window size is
  hill-climbed on the hit rate of each 10 x capacity accesses.
* ``wtinylfu-long``: the same, with the sketch halved every 100 x capacity additions (the
  synthetic trace reuses blocks at distances far beyond 10 x a small cache).
* ``lfu-history``: least frequently used, counts kept for evicted keys too; ties go to the
  least recent. On chained prefixes a block is never counted more often than its parent, so
  LFU evicts leaves first by construction.
* ``lfu-da``: LFU with dynamic aging (priority = L + count, L = the last victim's priority),
  counts remembered for 4 x capacity evicted keys; a store's last block enters at priority L.
* ``lru2`` / ``lru2-w4``: LRU-2 (O'Neil, O'Neil, Weikum, SIGMOD'93): evict by the second-last
  access; once-seen blocks first (``lru2``) or when 4 x their age reaches the second-last
  access age of the oldest reused block (``lru2-w4``).
* ``probation-main``: the adaptive LRU's two queues (new blocks on probation, used or
  remembered blocks in main, probation age weighted x4) with a history of 8 x capacity
  evicted keys instead of 1 x, so a block reused long after eviction comes back into main.
* ``lhd`` / ``leaf-lhd``: least hit density (Beckmann, Chen, Cidon, NSDI'18), every block of
  size 1: per class (a block's access count, capped at 6, remembered for 8 x capacity evicted
  keys), histograms of the ages at which blocks were hit or evicted (age = block accesses
  since the block's last access, bins of capacity / 16), decayed x 0.9 and turned into hit
  density (hits per remaining lifetime at each age) every capacity accesses; the victim is
  the lowest density among 32 blocks sampled at random (fixed seed). ``leaf-lhd`` samples
  only leaves of the prefix tree (cached blocks with no cached child), so a prefix never
  loses a block before its descendants.
* ``sampled-lru``: the control for the two above: the same leaf sampling, victim = the least
  recently used of the 32 sampled blocks (what sampling costs by itself).
* ``lru3``: LRU-K with K = 3 (same paper as ``lru2``), access times kept for 8 x capacity
  evicted keys; blocks with fewer than 3 accesses first (fewest first, then oldest first
  access), then the oldest third-last access.
* ``nextuse``: Belady with estimates: a block's reuse gap g is its own gap (EWMA, kept for
  8 x capacity evicted keys); a block not reused yet gets the learned mean first-reuse gap
  divided by the learned probability of a first reuse. Its expected next use is
  ``t_last + max(g, 2 x age)`` (an overdue block is expected later the longer it stays
  away); the victim is the later of the heap's largest ``t_last + g`` and the LRU block.
* ``gdsf-doc`` / ``gdsf-doc2``: GDSF (Cherkasova 1998) with the frequency of the block's
  *document*: priority = L + requests so far of the request's document (its first block, or
  its first two blocks), remembered for every document; L = the last victim's priority
  (inflation); equal priorities go LRU, a store's tail first.

* ``doc-half`` / ``doc-quarter`` / ``doc-eighth``: LRU keeping a hashed share (1/2, 1/4,
  1/8) of the documents (a request's document: its first block with fewer than two distinct
  children so far) plus every document requested before: their stored suffixes enter at the
  MRU end, the others at the LRU end, tail first (bimodal insertion, Qureshi et al.,
  ISCA'07, per document). ``doc-quarter-hash`` keeps only the hashed quarter;
  ``doc-reused-*`` only the hashed share of the documents requested before.
* ``doc-duel``: the share of ``doc-*`` (and whether reused documents are kept) follows the
  best of seven full-size replicas, scored on hits halved every 2 x capacity requested blocks.
* ``lru2-doc-quarter`` / ``lru2-doc-eighth`` / ``lru2-doc-duel``: ``lru2`` whose once-seen
  blocks of unselected documents enter probation at its LRU end; the duel picks the share
  among 1, 1/2, 1/4, 1/8 and 1/16 the same way.
* ``ghost-admit`` / ``ghost-admit-5``: LRU with a dead-block predictor learned online: per
  feature bucket (distance from the request's end, earlier requests of the document,
  whether the request hit past its shared roots) the share of stored blocks used again
  within 8 x capacity requested blocks; blocks whose bucket is below 0.2 (0.05) enter at the
  LRU end.
* ``doc-nextuse``: Belady with a per-document model of when a document returns: per number
  of requests so far, the learned odds of a return and mean gap (the document's own gap from
  its third request on); expected next request = last + gap / odds, at least 2 x the time
  away; the deepest block of the document expected last goes first, each request's last
  stored block before everything, shared roots after.

``python -m research.policy_features`` shows what such features know about whether a new
suffix comes back. ``python -m research.policy_oracles`` gives ceilings for whole families of
such rules (rules that know the future counts or the dead blocks exactly).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from kvcache_offload.lab.belady import belady_hits
from kvcache_offload.lab.sweep import parse_capacities
from kvcache_offload.lab.trace import (
    default_trace_paths,
    load_trace,
    trace_from_requests,
)
from research._output import write_json


class Policy(Protocol):
    cap: int

    def __contains__(self, key: int) -> bool: ...
    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None: ...
    def store(self, keys: Sequence[int], protected: set[int]) -> None: ...


def replay(requests: Sequence[Sequence[int]], policy: Policy) -> float:
    """Block hit rate of ``policy`` under the replay driver's call sequence."""
    hits = blocks = 0
    empty: frozenset[int] = frozenset()
    for keys in requests:
        n = 0
        for key in keys:
            if key not in policy:
                break
            n += 1
        hits += n
        blocks += len(keys)
        policy.touch(keys, empty)
        missing = [k for k in dict.fromkeys(keys) if k not in policy]
        if missing and len(missing) <= policy.cap:
            policy.store(missing, {k for k in keys if k in policy})
            policy.touch(keys, frozenset(missing))
    return hits / blocks if blocks else 0.0


class LRU:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.q: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self.q

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        for k in reversed(keys):
            if k in self.q:
                self.q.move_to_end(k)

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        need = len(self.q) + len(keys) - self.cap
        victims = []
        for k in self.q:
            if need <= len(victims):
                break
            if k not in protected:
                victims.append(k)
        for k in victims:
            del self.q[k]
        for k in keys:
            self.q[k] = None


class Sketch:
    """Count-min sketch, 4 rows of 4-bit saturating counters, doorkeeper, periodic halving."""

    def __init__(self, cap: int, sample_mult: int) -> None:
        width = 16
        while width < cap:
            width <<= 1
        self.mask = width - 1
        self.rows = [[0] * width for _ in range(4)]
        self.door: set[int] = set()
        self.added = 0
        self.sample = sample_mult * max(cap, 16)

    def _index(self, key: int) -> tuple[int, int, int, int]:
        h = (key * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        m = self.mask
        return h & m, (h >> 16) & m, (h >> 32) & m, (h >> 48) & m

    def freq(self, key: int) -> int:
        i, r = self._index(key), self.rows
        return min(r[0][i[0]], r[1][i[1]], r[2][i[2]], r[3][i[3]]) + (key in self.door)

    def add(self, key: int) -> None:
        if key not in self.door:
            self.door.add(key)
        else:
            i, r = self._index(key), self.rows
            f = min(r[0][i[0]], r[1][i[1]], r[2][i[2]], r[3][i[3]])
            if f < 15:
                for j in range(4):
                    if r[j][i[j]] == f:
                        r[j][i[j]] = f + 1
        self.added += 1
        if self.added >= self.sample:
            self.added //= 2
            for row in self.rows:
                row[:] = [c >> 1 for c in row]
            self.door.clear()


class WTinyLFU:
    def __init__(self, cap: int, sample_mult: int = 10) -> None:
        self.cap = cap
        self.wmax = max(1, round(cap * 0.01))
        self.win: OrderedDict[int, None] = OrderedDict()
        self.prob: OrderedDict[int, None] = OrderedDict()
        self.prot: OrderedDict[int, None] = OrderedDict()
        self.sketch = Sketch(cap, sample_mult)
        self.hits = self.accesses = 0
        self.prev_rate = 0.0
        self.step = 0.0625 * cap
        self.period = 10 * cap

    def __contains__(self, key: int) -> bool:
        return key in self.win or key in self.prob or key in self.prot

    def _climb(self) -> None:
        if self.accesses < self.period:
            return
        rate = self.hits / self.accesses
        self.step = (-self.step if rate < self.prev_rate else self.step) * 0.98
        self.prev_rate, self.hits, self.accesses = rate, 0, 0
        self.wmax = int(min(self.cap * 0.8, max(1, self.wmax + self.step)))

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        for k in reversed(keys):
            if k in self.win:
                self.win.move_to_end(k)
            elif k in new:
                continue
            elif k in self.prob:
                del self.prob[k]
                self.prot[k] = None
                limit = int((self.cap - self.wmax) * 0.8)
                while len(self.prot) > limit:
                    v, _ = self.prot.popitem(last=False)
                    self.prob[v] = None
            elif k in self.prot:
                self.prot.move_to_end(k)
            else:
                continue
            if k not in new:
                self.sketch.add(k)
                self.hits += 1
                self.accesses += 1
        self._climb()

    def _main_victim(self, protected: set[int]) -> int | None:
        for queue in (self.prob, self.prot):
            for k in queue:
                if k not in protected:
                    return k
        return None

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        for k in keys:
            self.sketch.add(k)
            self.accesses += 1
        for k in reversed(keys):
            self.win[k] = None
        total = len(self.win) + len(self.prob) + len(self.prot)
        while len(self.win) > self.wmax or total > self.cap:
            cand = next((k for k in self.win if k not in protected), None)
            if cand is None:
                victim = self._main_victim(protected)
                if victim is None:
                    break
                self.prob.pop(victim, None) if victim in self.prob else self.prot.pop(victim)
                total -= 1
                continue
            del self.win[cand]
            if total <= self.cap:
                self.prob[cand] = None
                continue
            victim = self._main_victim(protected)
            if victim is not None and self.sketch.freq(cand) > self.sketch.freq(victim):
                self.prob.pop(victim, None) if victim in self.prob else self.prot.pop(victim)
                self.prob[cand] = None
            total -= 1


def pop_victims(
    heap: list[Any], entry: dict[int, Any], need: int, protected: set[int]
) -> Iterator[Any]:
    """The ``need`` lowest live, unprotected entries of a lazily deleted heap, each removed
    from ``entry`` before it is yielded (entries end with ``(..., key)`` at index 2; an
    entry is live while ``entry[key]`` is it). Protected entries go back on the heap."""
    skipped = []
    try:
        while need > 0 and heap:
            e = heapq.heappop(heap)
            key = e[2]
            if entry.get(key) is not e:
                continue
            if key in protected:
                skipped.append(e)
                continue
            del entry[key]
            need -= 1
            yield e
    finally:
        for e in skipped:
            heapq.heappush(heap, e)


class LFU:
    """LFU (``aging=False``, counts kept forever) or LFU-DA (priority = L + count)."""

    def __init__(self, cap: int, aging: bool = False, history: float = 0.0) -> None:
        self.cap = cap
        self.aging = aging
        self.count: dict[int, int] = {}
        self.entry: dict[int, tuple[float, int, int]] = {}
        self.heap: list[tuple[float, int, int]] = []
        self.clock = 0.0
        self.now = 0
        self.history: OrderedDict[int, int] = OrderedDict()
        self.history_size = int(history * cap)

    def __contains__(self, key: int) -> bool:
        return key in self.entry

    def _push(self, key: int, priority: float) -> None:
        self.now += 1
        e = (priority, self.now, key)
        self.entry[key] = e
        heapq.heappush(self.heap, e)

    def _priority(self, key: int) -> float:
        return self.count[key] + (self.clock if self.aging else 0.0)

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        for k in reversed(keys):
            if k in self.entry and k not in new:
                self.count[k] += 1
                self._push(k, self._priority(k))

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        need = len(self.entry) + len(keys) - self.cap
        for e in pop_victims(self.heap, self.entry, need, protected):
            if self.aging:
                k = e[2]
                self.clock = e[0]
                c = self.count.pop(k)
                if self.history_size:
                    self.history[k] = c
                    if len(self.history) > self.history_size:
                        self.history.popitem(last=False)
        for i, k in enumerate(reversed(keys)):
            self.count[k] = self.count.get(k, 0) + self.history.pop(k, 0) + 1
            tail = self.aging and i == 0
            self._push(k, self.clock if tail else self._priority(k))


class ProbationMain:
    def __init__(self, cap: int, weight: float = 4.0, history: float = 8.0) -> None:
        self.cap = cap
        self.weight = weight
        self.history_size = max(1, int(history * cap))
        self.prob: OrderedDict[int, int] = OrderedDict()
        self.main: OrderedDict[int, int] = OrderedDict()
        self.history: OrderedDict[int, None] = OrderedDict()
        self.now = 0

    def __contains__(self, key: int) -> bool:
        return key in self.prob or key in self.main

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        for k in reversed(keys):
            self.now += 1
            if k in new:
                if k in self.prob and self.prob[k] >= 0:
                    self.prob[k] = self.now
                    self.prob.move_to_end(k)
            elif k in self.main:
                self.main[k] = self.now
                self.main.move_to_end(k)
            elif k in self.prob:
                del self.prob[k]
                self.main[k] = self.now

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        need = len(self.prob) + len(self.main) + len(keys) - self.cap
        if need > 0:
            on_prob = ((k, s) for k, s in self.prob.items() if k not in protected)
            in_main = ((k, s) for k, s in self.main.items() if k not in protected)
            p, m, now = next(on_prob, None), next(in_main, None), self.now
            chosen: list[tuple[int, OrderedDict[int, int]]] = []
            for _ in range(need):
                if p is not None and (m is None or (now - p[1]) * self.weight >= now - m[1]):
                    chosen.append((p[0], self.prob))
                    p = next(on_prob, None)
                elif m is not None:
                    chosen.append((m[0], self.main))
                    m = next(in_main, None)
            for k, queue in chosen:
                del queue[k]
                self.history[k] = None
            while len(self.history) > self.history_size:
                self.history.popitem(last=False)
        for i, k in enumerate(reversed(keys)):
            self.now += 1
            if k in self.history:
                del self.history[k]
                self.main[k] = self.now
            elif i == 0:  # the store's last block: first to go (the adaptive LRU's dead tail)
                self.prob[k] = -(1 << 60)
                self.prob.move_to_end(k, last=False)
            else:
                self.prob[k] = self.now


class LRU2:
    """LRU-2 (O'Neil et al., SIGMOD'93): evict by the second-last access time.

    Blocks accessed once sit in an LRU probation queue, blocks accessed twice or more in a
    heap by their second-last access; probation's head goes first if ``weight`` x its age is
    at least the age of main's head's second-last access (``weight`` = inf: once-seen blocks
    always go first, the classic LRU-2). Access times are remembered for evicted keys too.
    """

    def __init__(self, cap: int, weight: float = float("inf")) -> None:
        self.cap = cap
        self.weight = weight
        self.now = 0
        self.times: dict[int, tuple[int, int]] = {}
        self.prob: OrderedDict[int, int] = OrderedDict()
        self.main: dict[int, tuple[int, int, int]] = {}
        self.heap: list[tuple[int, int, int]] = []

    def __contains__(self, key: int) -> bool:
        return key in self.prob or key in self.main

    def _access(self, key: int) -> None:
        self.now += 1
        last = self.times.get(key, (-1, -1))[1]
        self.times[key] = (last, self.now)
        if last < 0:
            self.prob[key] = self.now
            self.prob.move_to_end(key)
        else:
            self.prob.pop(key, None)
            e = (last, self.now, key)
            self.main[key] = e
            heapq.heappush(self.heap, e)

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        for k in reversed(keys):
            if k not in new and k in self:
                self._access(k)

    def _main_head(
        self, protected: set[int], skipped: list[tuple[int, int, int]]
    ) -> tuple[int, int, int] | None:
        heap = self.heap
        while heap:
            e = heap[0]
            if self.main.get(e[2]) is not e:
                heapq.heappop(heap)
            elif e[2] in protected:
                skipped.append(heapq.heappop(heap))
            else:
                return e
        return None

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        need = len(self.prob) + len(self.main) + len(keys) - self.cap
        skipped: list[tuple[int, int, int]] = []
        on_prob = iter([k for k in self.prob if k not in protected] if need > 0 else [])
        p = next(on_prob, None)
        while need > 0:
            m = self._main_head(protected, skipped)
            if p is not None and (
                m is None or self.weight * (self.now - self.prob[p]) >= self.now - m[0]
            ):
                del self.prob[p]
                p = next(on_prob, None)
            elif m is not None:
                heapq.heappop(self.heap)
                del self.main[m[2]]
            else:
                break
            need -= 1
        for e in skipped:
            heapq.heappush(self.heap, e)
        for k in reversed(keys):
            self._access(k)


class _Sampled:
    """Victims by sampling (LHD's mechanism): 32 random leaves (``leaf``) or blocks, lowest
    :meth:`_score` goes. Subclasses score; this class keeps the blocks, their last access,
    their access count (also for 8 x capacity evicted keys) and the prefix tree."""

    sample = 32

    def __init__(self, cap: int, leaf: bool = True, history: float = 8.0) -> None:
        self.cap = cap
        self.leaf = leaf
        self.now = 0
        self.meta: dict[int, list[int]] = {}  # key -> [last access, accesses]
        self.pool: list[int] = []  # the blocks victims are sampled from
        self.pos: dict[int, int] = {}
        self.parent: dict[int, int] = {}
        self.children: dict[int, int] = {}  # cached children of each cached block
        self.ghost: OrderedDict[int, int] = OrderedDict()  # evicted key -> accesses
        self.history = max(1, int(history * cap))
        self.rng = random.Random(12345)

    def __contains__(self, key: int) -> bool:
        return key in self.meta

    def _pool_add(self, key: int) -> None:
        self.pos[key] = len(self.pool)
        self.pool.append(key)

    def _pool_remove(self, key: int) -> None:
        i = self.pos.pop(key)
        last = self.pool.pop()
        if i < len(self.pool):
            self.pool[i] = last
            self.pos[last] = i

    def _learn_tree(self, keys: Sequence[int]) -> None:
        for i in range(1, len(keys)):
            self.parent.setdefault(keys[i], keys[i - 1])

    def _hit(self, meta: list[int]) -> None:
        """A cached block used again (before its meta is updated)."""

    def _evicted(self, meta: list[int]) -> None:
        """A block evicted (meta as it was)."""

    def _tick(self) -> None:
        self.now += 1

    def _access(self, key: int) -> None:
        self._tick()
        meta = self.meta.get(key)
        if meta is not None:
            self._hit(meta)
            meta[0] = self.now
            meta[1] += 1
            return
        self.meta[key] = [self.now, self.ghost.pop(key, 0) + 1]
        self.children.setdefault(key, 0)
        parent = self.parent.get(key)
        if self.leaf and parent is not None and parent in self.meta:
            if self.children[parent] == 0:
                self._pool_remove(parent)
            self.children[parent] += 1
        if not self.leaf or self.children[key] == 0:
            self._pool_add(key)

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        self._learn_tree(keys)
        for key in reversed(keys):
            if key in self.meta and key not in new:
                self._access(key)

    def _score(self, meta: list[int]) -> float:
        raise NotImplementedError

    def _victim(self, protected: set[int]) -> int | None:
        best, best_score = None, 0.0
        pool, meta = self.pool, self.meta
        for _ in range(self.sample):
            key = pool[self.rng.randrange(len(pool))]
            if key in protected:
                continue
            score = self._score(meta[key])
            if best is None or score < best_score:
                best, best_score = key, score
        if best is None:  # every sampled block protected: the first unprotected one
            best = next((k for k in pool if k not in protected), None)
        return best

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        self._learn_tree(keys)
        need = len(self.meta) + len(keys) - self.cap
        while need > 0 and self.pool:
            key = self._victim(protected)
            if key is None:
                break
            meta = self.meta.pop(key)
            self._evicted(meta)
            self._pool_remove(key)
            del self.children[key]
            parent = self.parent.get(key)
            if self.leaf and parent is not None and parent in self.meta:
                self.children[parent] -= 1
                if self.children[parent] == 0:
                    self._pool_add(parent)
            self.ghost[key] = meta[1]
            if len(self.ghost) > self.history:
                self.ghost.popitem(last=False)
            need -= 1
        for key in reversed(keys):
            self._access(key)


class SampledLRU(_Sampled):
    def _score(self, meta: list[int]) -> float:
        return meta[0]


class LHD(_Sampled):
    """Least hit density over classes of access count (see the module docstring)."""

    classes = 6
    bins = 512

    def __init__(self, cap: int, leaf: bool = False) -> None:
        super().__init__(cap, leaf)
        self.width = max(1, cap // 16)
        self.hits = [[0.0] * self.bins for _ in range(self.classes + 1)]
        self.evictions = [[0.0] * self.bins for _ in range(self.classes + 1)]
        self.density: list[list[float]] | None = None
        self.period = max(1000, cap)
        self.since = 0

    def _bin(self, meta: list[int]) -> int:
        return min((self.now - meta[0]) // self.width, self.bins - 1)

    def _hit(self, meta: list[int]) -> None:
        self.hits[min(meta[1], self.classes)][self._bin(meta)] += 1

    def _evicted(self, meta: list[int]) -> None:
        self.evictions[min(meta[1], self.classes)][self._bin(meta)] += 1

    def _tick(self) -> None:
        self.now += 1
        self.since += 1
        if self.since < self.period:
            return
        self.since = 0
        density = []
        for hits, evictions in zip(self.hits, self.evictions, strict=True):
            row = [0.0] * self.bins
            hit_sum = events = lifetime = 0.0
            for age in range(self.bins - 1, -1, -1):
                hit_sum += hits[age]
                events += hits[age] + evictions[age]
                lifetime += events
                row[age] = hit_sum / lifetime if lifetime > 0 else 0.0
                hits[age] *= 0.9
                evictions[age] *= 0.9
            density.append(row)
        self.density = density

    def _score(self, meta: list[int]) -> float:
        if self.density is None:  # nothing learned yet: LRU
            return meta[0] - self.now
        return self.density[min(meta[1], self.classes)][self._bin(meta)]


class LRUK:
    """LRU-K: fewer than K accesses first (fewest, then oldest first access), then the
    oldest K-th last access; access times kept for ``history`` x capacity evicted keys."""

    def __init__(self, cap: int, k: int = 3, history: float = 8.0) -> None:
        self.cap = cap
        self.k = k
        self.now = 0
        self.times: dict[int, list[int]] = {}
        self.entry: dict[int, tuple[int, int, int]] = {}
        self.heap: list[tuple[int, int, int]] = []
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.history = max(1, int(history * cap))

    def __contains__(self, key: int) -> bool:
        return key in self.entry

    def _access(self, key: int) -> None:
        self.now += 1
        self.ghost.pop(key, None)
        times = self.times.setdefault(key, [])
        times.append(self.now)
        if len(times) > self.k:
            del times[0]
        e = (min(len(times), self.k), times[0], key)
        self.entry[key] = e
        heapq.heappush(self.heap, e)

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        for k in reversed(keys):
            if k in self.entry and k not in new:
                self._access(k)

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        need = len(self.entry) + len(keys) - self.cap
        for e in pop_victims(self.heap, self.entry, need, protected):
            self.ghost[e[2]] = None
            if len(self.ghost) > self.history:
                gone, _ = self.ghost.popitem(last=False)
                del self.times[gone]
        for k in reversed(keys):
            self._access(k)


class NextUse:
    """Belady with estimated next uses (see the module docstring)."""

    def __init__(self, cap: int, overdue: float = 2.0, history: float = 8.0) -> None:
        self.cap = cap
        self.overdue = overdue
        self.now = 0
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.meta: dict[int, list[float]] = {}  # key -> [last access, gap (-1: none), stamp]
        self.heap: list[tuple[float, int, int]] = []  # (-(last + gap), stamp, key)
        self.ghost: OrderedDict[int, list[float]] = OrderedDict()
        self.history = max(1, int(history * cap))
        self.first_gaps = [1.0, float(cap)]  # first reuses seen, sum of their gaps
        self.first_odds = [1.0, 1.0]  # first reuses seen, blocks evicted before one

    def __contains__(self, key: int) -> bool:
        return key in self.lru

    def _gap(self, meta: list[float]) -> float:
        if meta[1] >= 0:
            return meta[1]
        mean = self.first_gaps[1] / self.first_gaps[0]
        return mean * self.first_odds[1] / self.first_odds[0]

    def _expected(self, meta: list[float]) -> float:
        return meta[0] + max(self._gap(meta), self.overdue * (self.now - meta[0]))

    def _access(self, key: int) -> None:
        self.now += 1
        meta = self.meta.get(key) or self.ghost.pop(key, None)
        if meta is None:
            meta = [float(self.now), -1.0, 0.0]
        else:
            gap = self.now - meta[0]
            if meta[1] < 0:
                self.first_gaps[0] += 1
                self.first_gaps[1] += gap
                self.first_odds[0] += 1
                meta[1] = gap
            else:
                meta[1] = 0.5 * meta[1] + 0.5 * gap
            meta[0] = self.now
        meta[2] = self.now
        self.meta[key] = meta
        self.lru[key] = None
        self.lru.move_to_end(key)
        heapq.heappush(self.heap, (-(meta[0] + self._gap(meta)), self.now, key))

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        for k in reversed(keys):
            if k in self.lru and k not in new:
                self._access(k)

    def _top(self, protected: set[int], skipped: list[tuple[float, int, int]]) -> int | None:
        heap = self.heap
        while heap:
            e = heap[0]
            meta = self.meta.get(e[2])
            if meta is None or meta[2] != e[1]:
                heapq.heappop(heap)
            elif e[2] in protected:
                skipped.append(heapq.heappop(heap))
            else:
                return e[2]
        return None

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        need = len(self.lru) + len(keys) - self.cap
        skipped: list[tuple[float, int, int]] = []
        while need > 0:
            top = self._top(protected, skipped)
            oldest = next((k for k in self.lru if k not in protected), None)
            if top is None or oldest is None:
                victim = oldest if top is None else top
            elif self._expected(self.meta[oldest]) >= self._expected(self.meta[top]):
                victim = oldest
            else:
                victim = top
            if victim is None:
                break
            meta = self.meta.pop(victim)
            del self.lru[victim]
            if meta[1] < 0:
                self.first_odds[1] += 1
            self.ghost[victim] = meta
            if len(self.ghost) > self.history:
                self.ghost.popitem(last=False)
            need -= 1
        for e in skipped:
            heapq.heappush(self.heap, e)
        for k in reversed(keys):
            self._access(k)


class GDSFDoc:
    """GDSF with per-document request counts (see the module docstring)."""

    def __init__(self, cap: int, depth: int = 1) -> None:
        self.cap = cap
        self.depth = depth
        self.docs: dict[tuple[int, ...], int] = {}
        self.inflation = 0.0
        self.now = 0
        self.entry: dict[int, tuple[float, int, int]] = {}
        self.heap: list[tuple[float, int, int]] = []
        self.count = 1

    def __contains__(self, key: int) -> bool:
        return key in self.entry

    def _push(self, key: int) -> None:
        self.now += 1
        e = (self.inflation + self.count, self.now, key)
        self.entry[key] = e
        heapq.heappush(self.heap, e)

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        if not new:  # the request's first touch: one more request of its document
            doc = tuple(keys[: self.depth])
            self.count = self.docs[doc] = self.docs.get(doc, 0) + 1
        for k in reversed(keys):
            if k in self.entry and k not in new:
                self._push(k)

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        need = len(self.entry) + len(keys) - self.cap
        for e in pop_victims(self.heap, self.entry, need, protected):
            self.inflation = e[0]
        for k in reversed(keys):
            self._push(k)


def _doc_of(keys: Sequence[int], children: dict[int, set[int]]) -> int:
    """A request's document: its first block with fewer than two distinct children so far
    (the blocks above it are shared roots, such as a system prompt every request starts
    with). Registers the request's parent -> child links afterwards."""
    doc = keys[-1]
    for k in keys:
        if len(children.get(k, ())) < 2:
            doc = k
            break
    for a, b in itertools.pairwise(keys):
        children.setdefault(a, set()).add(b)
    return doc


def _selected(doc: int, share: float) -> bool:
    """Whether a document falls in the hashed ``share`` of all documents (nested in share)."""
    h = ((doc * 0x9E3779B97F4A7C15) >> 11) & 0xFFFFF
    return h < share * 0x100000


class DocInsert(LRU):
    """LRU that keeps only a hashed share of the documents (see the module docstring):
    a stored suffix goes to the MRU end when its document is selected (or, with
    ``reused``, requested before), else to the LRU end (first to go, tail first)."""

    def __init__(
        self, cap: int, share: float = 0.25, reused: bool = True, both: bool = False
    ) -> None:
        super().__init__(cap)
        self.share = share
        self.reused = reused
        self.both = both
        self.children: dict[int, set[int]] = {}
        self.requests: dict[int, int] = {}
        self.keep = True

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        if not new:
            doc = _doc_of(keys, self.children)
            seen = self.requests.get(doc, 0)
            self.requests[doc] = seen + 1
            if self.both:  # a selected document, requested before
                self.keep = seen > 0 and _selected(doc, self.share)
            else:
                self.keep = _selected(doc, self.share) or (self.reused and seen > 0)
        for k in reversed(keys):
            if k in self.q and k not in new:
                self.q.move_to_end(k)

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        super().store(keys, protected)
        if not self.keep:
            for k in keys:
                self.q.move_to_end(k, last=False)


def _step(policy: Policy, keys: Sequence[int]) -> int:
    """One request of the replay driver on ``policy``; returns its prefix hits."""
    n = 0
    for key in keys:
        if key not in policy:
            break
        n += 1
    policy.touch(keys, frozenset())
    missing = [k for k in dict.fromkeys(keys) if k not in policy]
    if missing and len(missing) <= policy.cap:
        policy.store(missing, {k for k in keys if k in policy})
        policy.touch(keys, frozenset(missing))
    return n


class ReplicaDuel:
    """Full-size replicas played on the same requests, each scored on its hits, the scores
    halved every ``period`` x capacity requested blocks (set dueling, Qureshi et al.,
    ISCA'07, with whole replicas instead of sampled sets)."""

    def __init__(self, replicas: Sequence[Policy], cap: int, period: float) -> None:
        self.replicas = list(replicas)
        self.scores = [0.0] * len(self.replicas)
        self.period = max(1, int(period * cap))
        self.seen = 0

    def leader_after(self, keys: Sequence[int]) -> int:
        """Play one request on every replica; the index of the best-scoring one."""
        for i, r in enumerate(self.replicas):
            self.scores[i] += _step(r, keys)
        self.seen += len(keys)
        if self.seen >= self.period:
            self.seen = 0
            self.scores = [x / 2 for x in self.scores]
        return max(range(len(self.scores)), key=self.scores.__getitem__)


class DuelDoc(DocInsert):
    """:class:`DocInsert` whose share (and reused rule) follow the best of full-size
    replicas, one per setting, scored on hits decayed by half every ``period`` x capacity
    requested blocks (set dueling, Qureshi et al., ISCA'07, with whole replicas)."""

    settings = ((1.0, True), (0.5, True), (0.25, True), (0.125, True),
                (0.25, False), (0.125, False), (0.0625, False))  # fmt: skip

    def __init__(self, cap: int, period: float = 2.0) -> None:
        super().__init__(cap, 1.0)
        self.duel = ReplicaDuel([DocInsert(cap, f, r) for f, r in self.settings], cap, period)

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        if not new:
            self.share, self.reused = self.settings[self.duel.leader_after(keys)]
        super().touch(keys, new)


class LRU2Doc(LRU2):
    """:class:`LRU2` whose once-seen blocks of unselected documents (a hashed ``share``,
    as in :class:`DocInsert`) enter probation at its LRU end instead of its MRU end."""

    def __init__(self, cap: int, share: float = 0.25) -> None:
        super().__init__(cap)
        self.share = share
        self.children: dict[int, set[int]] = {}
        self.keep = True

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        if not new:
            self.keep = _selected(_doc_of(keys, self.children), self.share)
        super().touch(keys, new)

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        super().store(keys, protected)
        if not self.keep:
            for k in keys:
                if k in self.prob:
                    self.prob.move_to_end(k, last=False)


class DuelLRU2Doc(LRU2Doc):
    """:class:`LRU2Doc` whose share follows the best of full-size replicas (as
    :class:`DuelDoc`)."""

    shares = (1.0, 0.5, 0.25, 0.125, 0.0625)

    def __init__(self, cap: int, period: float = 2.0) -> None:
        super().__init__(cap, 1.0)
        self.duel = ReplicaDuel([LRU2Doc(cap, f) for f in self.shares], cap, period)

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        if not new:
            self.share = self.shares[self.duel.leader_after(keys)]
        super().touch(keys, new)


class DocNextUse:
    """Belady with a per-document model of *when* a document returns (see the module
    docstring): every block below a request's shared roots belongs to the document of the
    last request that used it, and documents go by expected next request, deepest block
    first. Each request's last stored block goes before all of them, shared roots after."""

    levels = 8

    def __init__(self, cap: int, overdue: float = 2.0) -> None:
        self.cap = cap
        self.overdue = overdue
        self.now = 0  # requests so far
        self.children: dict[int, set[int]] = {}
        self.owner: dict[int, int] = {}  # cached block -> its document (-1: root, -2: dead)
        self.depth: dict[int, int] = {}
        self.dead: OrderedDict[int, None] = OrderedDict()
        self.roots: OrderedDict[int, None] = OrderedDict()
        self.blocks: dict[int, list[tuple[int, int]]] = {}  # doc -> heap of (-depth, key)
        self.docs: dict[int, list[float]] = {}  # doc -> [requests, last request, own gap]
        self.recent: OrderedDict[int, None] = OrderedDict()  # docs with blocks, LRU order
        self.heap: list[tuple[float, int, int]] = []  # (-static expected, stamp, doc)
        self.stamp: dict[int, int] = {}
        self.reached = [1.0] * (self.levels + 1)
        self.returned = [1.0] * (self.levels + 1)
        self.gaps = [float(cap)] * (self.levels + 1)
        self.doc = -1
        self.index: dict[int, int] = {}
        self.last = -1

    def __contains__(self, key: int) -> bool:
        return key in self.owner

    def _gap(self, doc: int) -> float:
        n, _, own = self.docs[doc]
        lv = min(int(n), self.levels)
        mean = self.gaps[lv] / self.returned[lv]
        gap = own if own > 0 and n >= 3 else mean
        return gap * self.reached[lv] / self.returned[lv]

    def _expected(self, doc: int) -> float:
        last = self.docs[doc][1]
        return last + max(self._gap(doc), self.overdue * (self.now - last))

    def _push_doc(self, doc: int) -> None:
        st = self.stamp.get(doc, 0) + 1
        self.stamp[doc] = st
        heapq.heappush(self.heap, (-(self.docs[doc][1] + self._gap(doc)), st, doc))
        self.recent[doc] = None
        self.recent.move_to_end(doc)

    def _own(self, key: int, doc: int, depth: int) -> None:
        self.dead.pop(key, None)
        self.roots.pop(key, None)
        self.owner[key] = doc
        if doc == -1:
            self.roots[key] = None
        elif doc == -2:
            self.dead[key] = None
        else:
            self.depth[key] = depth
            heapq.heappush(self.blocks.setdefault(doc, []), (-depth, key))

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        if new:
            return
        self.now += 1
        doc = _doc_of(keys, self.children)
        meta = self.docs.get(doc)
        if meta is None:
            meta = self.docs[doc] = [0.0, float(self.now), -1.0]
        else:
            lv = min(int(meta[0]), self.levels)
            gap = self.now - meta[1]
            self.returned[lv] += 1
            self.gaps[lv] += gap
            meta[2] = gap if meta[2] < 0 else 0.5 * meta[2] + 0.5 * gap
        meta[0] += 1
        meta[1] = float(self.now)
        self.reached[min(int(meta[0]), self.levels)] += 1
        self.doc = doc
        self.index = {k: i for i, k in enumerate(keys)}
        self.last = keys[-1]
        root = True
        for i, k in enumerate(keys):
            if k == doc:
                root = False
            if k in self.owner:
                self._own(k, -1 if root else doc, i)
        self._push_doc(doc)

    def _pop_deepest(self, doc: int, protected: set[int]) -> int | None:
        heap = self.blocks.get(doc)
        skipped = []
        found = None
        while heap:
            d, k = heapq.heappop(heap)
            if self.owner.get(k) != doc or self.depth.get(k) != -d:
                continue
            if k in protected:
                skipped.append((d, k))
                continue
            found = k
            break
        if heap is None:
            self.recent.pop(doc, None)
            return None
        for e in skipped:
            heapq.heappush(heap, e)
        if not heap:
            del self.blocks[doc]
            self.recent.pop(doc, None)
        return found

    def _victim(self, protected: set[int]) -> int | None:
        for k in self.dead:
            if k not in protected:
                return k
        tried: set[int] = set()
        skipped = []
        found = None
        while found is None:
            top = None
            while self.heap:
                e = self.heap[0]
                if self.stamp.get(e[2]) != e[1] or e[2] not in self.blocks or e[2] in tried:
                    heapq.heappop(self.heap)
                    if self.stamp.get(e[2]) == e[1] and e[2] in tried:
                        skipped.append(e)
                    continue
                top = e[2]
                break
            oldest = next((d for d in self.recent if d not in tried), None)
            if top is None and oldest is None:
                break
            if oldest is not None and (
                top is None or self._expected(oldest) >= self._expected(top)
            ):
                doc = oldest
            else:
                doc = top
            found = self._pop_deepest(doc, protected)
            if found is None:
                tried.add(doc)
        for e in skipped:
            heapq.heappush(self.heap, e)
        if found is None:
            found = next((k for k in self.roots if k not in protected), None)
        return found

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        need = len(self.owner) + len(keys) - self.cap
        while need > 0:
            v = self._victim(protected)
            if v is None:
                break
            del self.owner[v]
            self.dead.pop(v, None)
            self.roots.pop(v, None)
            self.depth.pop(v, None)
            need -= 1
        doc = self.doc
        order = sorted(keys, key=lambda k: self.index.get(k, 0))
        doc_i = self.index.get(doc, 0)
        for k in order:
            i = self.index.get(k, 0)
            if k == self.last and k in keys:
                self._own(k, -2, i)
            else:
                self._own(k, -1 if i < doc_i else doc, i)
        self._push_doc(doc)


class GhostAdmit(LRU):
    """LRU with a learned dead-block admission predictor (see the module docstring): each
    stored block gets a feature bucket (distance from the request's end 0/1/2/3+, requests
    of its document before 0-3/4+, whether the request hit past its shared roots); a table
    learns per bucket how many stored blocks were used again within ``horizon`` x capacity
    requested blocks. A block whose bucket's estimate is below ``threshold`` enters at the
    LRU end (first to go), the others at the MRU end."""

    def __init__(self, cap: int, threshold: float = 0.2, horizon: float = 8.0) -> None:
        super().__init__(cap)
        self.threshold = threshold
        self.horizon = max(1, int(horizon * cap))
        self.children: dict[int, set[int]] = {}
        self.requests: dict[int, int] = {}
        self.table: dict[tuple[int, int, bool], list[int]] = {}  # bucket -> [reused, all]
        self.pending: OrderedDict[int, tuple[tuple[int, int, bool], int]] = OrderedDict()
        self.clock = 0
        self.buckets: dict[int, tuple[int, int, bool]] = {}

    def _learn(self, keys: Sequence[int]) -> None:
        for k in keys:
            got = self.pending.pop(k, None)
            if got is not None:
                self.table[got[0]][0] += 1
        while self.pending:
            k, (_, t) = next(iter(self.pending.items()))
            if self.clock - t < self.horizon:
                break
            del self.pending[k]

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        if not new:
            self.clock += len(keys)
            self._learn(keys)
            doc = _doc_of(keys, self.children)
            seen = self.requests.get(doc, 0)
            self.requests[doc] = seen + 1
            d = keys.index(doc) if doc in keys else 0
            n = 0
            for k in keys:
                if k not in self.q:
                    break
                n += 1
            deep = n > d
            last = len(keys) - 1
            self.buckets = {k: (min(last - i, 3), min(seen, 4), deep) for i, k in enumerate(keys)}
        for k in reversed(keys):
            if k in self.q and k not in new:
                self.q.move_to_end(k)

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        super().store(keys, protected)
        for k in reversed(keys):
            bucket = self.buckets.get(k, (3, 0, False))
            row = self.table.setdefault(bucket, [0, 0])
            if (row[0] + 1) / (row[1] + 2) < self.threshold:
                self.q.move_to_end(k, last=False)
            row[1] += 1
            self.pending[k] = (bucket, self.clock)


CANDIDATES: dict[str, Callable[[int], Policy]] = {
    "lru": LRU,
    "wtinylfu": WTinyLFU,
    "wtinylfu-long": lambda cap: WTinyLFU(cap, sample_mult=100),
    "lfu-history": LFU,
    "lfu-da": lambda cap: LFU(cap, aging=True, history=4.0),
    "probation-main": ProbationMain,
    "lru2": LRU2,
    "lru2-w4": lambda cap: LRU2(cap, weight=4.0),
    "lhd": LHD,
    "leaf-lhd": lambda cap: LHD(cap, leaf=True),
    "sampled-lru": SampledLRU,
    "lru3": LRUK,
    "nextuse": NextUse,
    "gdsf-doc": GDSFDoc,
    "gdsf-doc2": lambda cap: GDSFDoc(cap, depth=2),
    "doc-half": lambda cap: DocInsert(cap, 0.5),
    "doc-quarter": lambda cap: DocInsert(cap, 0.25),
    "doc-eighth": lambda cap: DocInsert(cap, 0.125),
    "doc-quarter-hash": lambda cap: DocInsert(cap, 0.25, reused=False),
    "doc-duel": DuelDoc,
    "doc-reused-quarter": lambda cap: DocInsert(cap, 0.25, both=True),
    "doc-reused-eighth": lambda cap: DocInsert(cap, 0.125, both=True),
    "doc-reused-16th": lambda cap: DocInsert(cap, 1 / 16, both=True),
    "doc-reused-32nd": lambda cap: DocInsert(cap, 1 / 32, both=True),
    "lru2-doc-quarter": LRU2Doc,
    "lru2-doc-eighth": lambda cap: LRU2Doc(cap, 0.125),
    "lru2-doc-duel": DuelLRU2Doc,
    "doc-nextuse": DocNextUse,
    "ghost-admit": GhostAdmit,
    "ghost-admit-5": lambda cap: GhostAdmit(cap, threshold=0.05),
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m research.policy_candidates")
    parser.add_argument("--capacities", default="1%,2%,5%,10%,20%,3%,7%,15%")
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--slices", type=int, default=1, help="also replay each 1/N of a trace")
    args = parser.parse_args(argv)
    names = args.candidates.split(",")
    rows = []
    for path in default_trace_paths():
        whole = load_trace(path)
        parts = [("all", whole)]
        if args.slices > 1:
            from kvcache_offload.lab.trace import iter_requests

            requests = list(iter_requests(path))
            size = -(-len(requests) // args.slices)
            for i in range(args.slices):
                chunk = requests[i * size : (i + 1) * size]
                parts.append((f"{i + 1}/{args.slices}", trace_from_requests(chunk, whole.name)))
        for label, trace in parts:
            for capacity in parse_capacities(args.capacities):
                blocks = capacity.blocks(trace.num_unique_blocks)
                bound = belady_hits(trace, blocks).block_hit_rate
                hit = {name: replay(trace.block_ids, CANDIDATES[name](blocks)) for name in names}
                lru = hit.get("lru", 0.0)
                gap = bound - lru
                row = {
                    "trace": trace.name,
                    "slice": label,
                    "capacity": capacity.label(),
                    "blocks": blocks,
                    "belady": bound,
                    "hit": hit,
                    "gap_closed": {n: (h - lru) / gap if gap > 0 else 0.0 for n, h in hit.items()},
                }
                rows.append(row)
                cells = " ".join(
                    f"{n}={100 * h:.2f}({100 * row['gap_closed'][n]:+.0f}%)" for n, h in hit.items()
                )
                print(
                    f"{trace.name} {label} {capacity.label()}: Belady={100 * bound:.2f} {cells}",
                    flush=True,
                )
    result = {"candidates": names, "rows": rows}
    write_json("policy-candidates", result)
    return result


if __name__ == "__main__":
    main()
