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
(``docs/policy-lab.md``). The Python copies (``_mini_cache.py``) are the fallback, and what
``KVCACHE_OFFLOAD_PURE_PYTHON=1`` runs.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, Final, cast

from kvcache_offload._compiled import pure_python_requested
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._mini_cache import KeyIds, MiniCache
from kvcache_offload.control.policies.base import BlockStatus

try:
    from kvcache_offload.control.policies._native_duel import NativeDuel as _NativeDuel
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _NativeDuel = None

__all__ = ["WeightDuel"]

HASH_SPACE: Final = 1 << 16
"""A key is sampled when 16 bits of its CRC-32 are below ``rate x HASH_SPACE``."""
_HASH_SPACE: Final = HASH_SPACE


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
        self._ids = KeyIds()
        self._caches: list[MiniCache] = []
        self._native: Any = None
        if native is None:
            native = native_duel_available()
        if native:
            if _NativeDuel is None:
                raise RuntimeError("the _native_duel extension is not built")
            self._native = _NativeDuel(capacity, self._weights, decay_every, initial_weight)
        else:
            self._caches = [MiniCache(w, capacity, self._ids) for w in self._weights]
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
