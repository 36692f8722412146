"""Live miss-ratio curve from sampled reuse distances (SHARDS, Waldspurger et al. FAST'15).

Answers "what would the hit ratio be with 2x (or 0.5x) the CPU tier?" while serving, in
bounded memory. Keys are sampled spatially: a key is tracked iff its hash falls below a
threshold, so every access of a tracked key is seen. The reuse distance of a tracked access
(distinct tracked keys since its previous access) divided by the sampling rate estimates
the full-stream LRU stack distance; an LRU cache of ``C`` blocks hits iff that is below
``C``. Fixed-size variant: at most ``max_keys`` keys are tracked; when one more would be
added the threshold drops to the largest tracked hash and those keys are forgotten, so the
rate adapts to the working set; counts taken at a higher rate are scaled down to the current
one (through one global weight, so a rate change costs O(1)). The SHARDS_adj correction moves
the difference between the expected and the actual number of sampled accesses into distance
zero.

Distances come from a Fenwick tree over access timestamps holding a 1 at each tracked key's
latest access; timestamps are renumbered (compacted) when the tree is full.

The estimate is for LRU. Lookups access their keys in prefix order; they are applied tail
first, the way the manager's ``touch`` leaves the first key most recent, so a block deep in
a prefix is never estimated to hit while its head misses (up to one position).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError

__all__ = ["DEFAULT_SCALES", "MissRatioCurve"]

DEFAULT_SCALES: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
_HASH_BITS = 32
_HASH_SPACE = 1 << _HASH_BITS
_HASH_MASK = _HASH_SPACE - 1
_BIN_BASE = 1.0 + 1.0 / 32  # histogram resolution: ~3% of the distance
_LOG_BASE = math.log(_BIN_BASE)


def _bin(distance: float) -> int:
    """Bin 0 holds distances below 1; bin b >= 1 holds [base**(b-1), base**b)."""
    if distance < 1.0:
        return 0
    return 1 + int(math.log(distance) / _LOG_BASE)


def _bin_bounds(b: int) -> tuple[float, float]:
    if b == 0:
        return 0.0, 1.0
    return _BIN_BASE ** (b - 1), _BIN_BASE**b


class _Fenwick:
    """Prefix sums over 0/1 marks at timestamps ``0 .. size-1``."""

    __slots__ = ("size", "tree")

    def __init__(self, size: int) -> None:
        self.size = size
        self.tree = [0] * (size + 1)

    def add(self, index: int, delta: int) -> None:
        tree, size = self.tree, self.size
        i = index + 1
        while i <= size:
            tree[i] += delta
            i += i & -i

    def prefix(self, index: int) -> int:
        """Sum of the marks at timestamps ``< index``."""
        tree = self.tree
        total = 0
        i = index
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    @classmethod
    def with_marks(cls, size: int, marks: Iterable[int]) -> _Fenwick:
        """A tree with a 1 at each of ``marks``, built in O(size)."""
        fen = cls(size)
        tree = fen.tree
        for index in marks:
            tree[index + 1] += 1
        for i in range(1, size + 1):
            parent = i + (i & -i)
            if parent <= size:
                tree[parent] += tree[i]
        return fen


class MissRatioCurve:
    """Engine access observer estimating LRU hit ratios at other capacities.

    ``sample_rate`` is the fraction of keys tracked at the start; it falls as needed to keep
    at most ``max_keys`` keys (memory: roughly 250 bytes per key). Starting high costs no
    memory and gives the most accurate curve the budget allows: a small fixed rate on a
    small working set leaves the curve to a few hundred keys and one hot key can swing it
    by several points. ``hash_fn`` picks the sample; the default (Python's ``hash``) is
    salted per process, which is fine for sampling.
    """

    def __init__(
        self,
        sample_rate: float = 1.0,
        max_keys: int = 8192,
        *,
        scales: Sequence[float] = DEFAULT_SCALES,
        hash_fn: Callable[[OffloadKey], int] = hash,
    ) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ConfigError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        if max_keys < 1:
            raise ConfigError(f"max_keys must be >= 1, got {max_keys!r}")
        self.scales = tuple(scales)
        self.max_keys = max_keys
        self._hash = hash_fn
        self._initial_threshold = max(1, round(sample_rate * _HASH_SPACE))
        self._tree_size = 2 * max_keys + 64
        self.reset()

    def reset(self) -> None:
        """Forget everything (e.g. after the cache was reset)."""
        self._threshold = self._initial_threshold
        self._rate = self._threshold / _HASH_SPACE
        self._last: dict[OffloadKey, int] = {}
        self._by_hash: list[tuple[int, OffloadKey]] = []  # max-heap via negated hashes
        self._fenwick = _Fenwick(self._tree_size)
        self._now = 0
        # Counts are kept in units where a sample taken now weighs ``_weight``; dividing by
        # ``_weight`` gives counts at the current rate.
        self._weight = 1.0
        self._hist: dict[int, float] = {}
        self._sampled = 0.0
        self._cold = 0
        self.accesses = 0

    # -- observer interface --------------------------------------------------------------

    def on_lookup(self, keys: Sequence[OffloadKey], hits: int) -> None:
        """Every key of a lookup is one access; the prefix order is applied tail first."""
        n = len(keys)
        if not n:
            return
        self.accesses += n
        threshold, hash_fn = self._threshold, self._hash
        for key in reversed(keys):
            if hash_fn(key) & _HASH_MASK < threshold:
                self._access(key)
                threshold = self._threshold

    def on_store(self, keys: Sequence[OffloadKey]) -> None:
        """Stores are not accesses: the lookup that preceded them already counted the keys."""

    # -- sampling and distances ----------------------------------------------------------

    def _access(self, key: OffloadKey) -> None:
        if self._now >= self._tree_size:
            self._compact()
        last = self._last
        fen = self._fenwick
        now = self._now
        weight = self._weight
        self._sampled += weight
        prev = last.get(key)
        if prev is None:
            self._cold += 1
            h = self._hash(key) & _HASH_MASK
            heapq.heappush(self._by_hash, (-h, key))
        else:
            distance = len(last) - fen.prefix(prev + 1)
            b = _bin(distance / self._rate)
            self._hist[b] = self._hist.get(b, 0.0) + weight
            fen.add(prev, -1)
        last[key] = now
        fen.add(now, 1)
        self._now = now + 1
        if len(last) > self.max_keys:
            self._lower_threshold()

    def _lower_threshold(self) -> None:
        """Drop the keys with the largest hash until ``max_keys`` remain; rate follows."""
        heap, last, fen = self._by_hash, self._last, self._fenwick
        while len(last) > self.max_keys:
            neg_h, _ = heap[0]
            self._threshold = -neg_h
            while heap and -heap[0][0] >= self._threshold:
                _, key = heapq.heappop(heap)
                fen.add(last.pop(key), -1)
        new_rate = self._threshold / _HASH_SPACE
        self._weight *= self._rate / new_rate
        self._rate = new_rate

    def _compact(self) -> None:
        """Renumber the latest accesses 0..k-1 in order and rebuild the tree."""
        order = sorted(self._last.items(), key=lambda item: item[1])
        self._last = {key: i for i, (key, _) in enumerate(order)}
        self._fenwick = _Fenwick.with_marks(self._tree_size, range(len(order)))
        self._now = len(order)

    # -- results -------------------------------------------------------------------------

    def hit_ratio(self, capacity_blocks: float) -> float:
        """Estimated block hit ratio of an LRU cache of ``capacity_blocks`` blocks."""
        if self._sampled == 0:
            return 0.0
        weight = self._weight
        sampled = self._sampled / weight
        expected = self.accesses * self._rate
        hits = 0.0
        for b, count in self._hist.items():
            low, high = _bin_bounds(b)
            if high <= capacity_blocks:
                hits += count
            elif low < capacity_blocks:
                hits += count * (capacity_blocks - low) / (high - low)
        # SHARDS_adj: the accesses the sample over- or under-represents count at distance 0.
        hits = hits / weight + (expected - sampled)
        return min(1.0, max(0.0, hits / expected))

    def mrc_stats(self, capacity_blocks: int) -> tuple[dict[float, float], int]:
        """Hit ratios at each scale x ``capacity_blocks``, and the number of keys tracked."""
        curve = {scale: self.hit_ratio(scale * capacity_blocks) for scale in self.scales}
        return curve, len(self._last)

    @property
    def sample_rate(self) -> float:
        """The current sampling rate (drops as the working set outgrows ``max_keys``)."""
        return self._rate

    def debug_state(self) -> dict[str, object]:
        return {
            "tracked_keys": len(self._last),
            "heap": len(self._by_hash),
            "tree_size": self._fenwick.size,
            "bins": len(self._hist),
            "sampled_accesses": self._sampled / self._weight,
            "cold": self._cold,
            "expected": self.accesses * self._rate,
            "rate": self._rate,
        }
