"""Miniature simulations of whole candidate policies, raced on a hashed sample of the keys.

Waldspurger et al. (FAST'15 SHARDS, ATC'17 miniature simulation): a cache fed the keys whose
hash falls below a threshold, scaled down by that sampling rate, shows the hit ratio of the
full-size cache. Each candidate runs as a real policy object of ``rate x capacity`` blocks,
driven per request as the manager drives the live one (hits up to the first miss, touch,
store the misses, touch again, complete), and scores its prefix hits with exponentially
decaying counts. The race names a new leader only when it beats the current one by a margin
in two evaluations in a row (hysteresis), so sampling noise does not make the live policy
flap. The hash uses other bits of the CRC than the miniatures inside the adaptive LRU, so a
candidate's own sample is not a sample of this one.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Final

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies.base import BlockStatus, CachePolicy

__all__ = ["ShadowRace"]

_HASH_SPACE = 1 << 16
_crc32: Final = zlib.crc32
"""Bound once: compiled, ``zlib.crc32`` in a function is a module attribute lookup per call."""


def _distinct(keys: list[OffloadKey]) -> list[OffloadKey]:
    """``keys`` without repeats, first occurrences in order. A request's sample is a few
    keys: compared pairwise, it costs less than ``dict.fromkeys`` (a generic class-method
    call and a dict); a long one still takes the dict."""
    n = len(keys)
    if n <= 1:
        return keys
    if n > 16:
        return list(dict.fromkeys(keys))
    out: list[OffloadKey] = []
    for index in range(n):
        key = keys[index]
        if key not in out:
            out.append(key)
    return out


class _Runner:
    """One candidate in miniature: its policy object, capacity and decaying hit count."""

    __slots__ = ("capacity", "hits", "name", "policy", "score", "spread")

    def __init__(self, name: str, policy: CachePolicy, capacity: int) -> None:
        self.name = name
        self.policy = policy
        self.capacity = capacity
        self.score = 0.0
        self.hits = 0
        # Decaying sum of squared per-request differences from the leader's hits.
        self.spread = 0.0

    def request(self, keys: list[OffloadKey]) -> int:
        """Serve one request's sampled keys (distinct, prefix order); its prefix hits."""
        policy = self.policy
        hits = 0
        for key in keys:
            if policy.get(key) is None:  # a native call; a bound ``get`` is a generic one
                break
            hits += 1
        policy.touch(keys)
        if hits == len(keys):
            return hits
        new = [key for key in keys[hits:] if policy.get(key) is None]
        need = len(policy) + len(new) - self.capacity
        free: list[BlockStatus] = []  # the victims' blocks, reused for the new keys
        if need > 0:
            gone: list[OffloadKey] = []
            if not policy.evict_blocks(need, (), gone, free):
                return hits
        blocks: list[BlockStatus] = []  # the new keys' blocks: no pair per key
        for _slot in range(len(new)):  # not ``_``: compiled, an int object per step
            block = free.pop() if free else BlockStatus(0)
            block.ref_cnt = -1
            blocks.append(block)
        policy.insert_blocks(new, blocks)
        policy.touch(keys)
        for block in blocks:
            block.ref_cnt = 0
        return hits


class ShadowRace:
    """Runs every candidate in miniature and names the one the live cache should run.

    ``window`` miniature capacities of sampled blocks make one evaluation; after each,
    scores are halved. A challenger takes the lead once its score exceeds the leader's by
    ``margin`` (relative) and by ``z`` standard deviations of the paired per-request
    differences, in two evaluations in a row.
    """

    def __init__(
        self,
        cache_capacity: int,
        candidates: Sequence[tuple[str, type[CachePolicy]]],
        *,
        shadow_blocks: int = 256,
        margin: float = 0.05,
        window: float = 4.0,
        z: float = 2.0,
        rest_lead: float = 0.25,
        rest_after: int = 2,
        rest_windows: float = 0.0,
    ) -> None:
        rate = min(1.0, shadow_blocks / max(cache_capacity, 1))
        self.rate = rate
        self._threshold = max(1, round(rate * _HASH_SPACE))
        capacity = max(1, round(rate * cache_capacity))
        self._runners = [_Runner(name, cls(capacity), capacity) for name, cls in candidates]
        self._window = max(1, round(window * capacity))
        self._margin = margin
        self._z = z
        self._seen = 0
        self._challenger = ""
        self.leader = self._runners[0].name
        self._leader_index = 0
        self.evaluations = 0
        self.switches = 0
        self.sampled_blocks = 0
        self._rest_lead = rest_lead
        self._rest_after = max(1, rest_after)
        # Keys of traffic per rest: ``rest_windows`` windows of sampled blocks, unsampled.
        self._rest_span = round(rest_windows * self._window / rate)
        self._calm = 0
        self.rest_keys = 0
        """Keys of traffic the caller still skips before the race runs again (see class doc)."""
        self.rests = 0

    def sample(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """The sampled keys of ``keys``, in order, without repeats."""
        threshold = self._threshold
        if threshold >= _HASH_SPACE:  # every key: no hash needed
            sampled = list(keys)
        elif isinstance(keys, list):  # by index: no generic iterator step per key
            sampled = []
            for index in range(len(keys)):
                key = keys[index]
                if (_crc32(key) >> 16) < threshold:
                    sampled.append(key)
        else:
            sampled = [key for key in keys if (_crc32(key) >> 16) < threshold]
        return _distinct(sampled)

    @property
    def threshold(self) -> int:
        """A key is sampled when its CRC's high 16 bits are below this."""
        return self._threshold

    @staticmethod
    def distinct(sampled: list[OffloadKey]) -> list[OffloadKey]:
        """``sampled`` without repeats, in order (what :meth:`sample` returns)."""
        return _distinct(sampled)

    def request(self, sampled: list[OffloadKey]) -> bool:
        """Feed one request's sampled keys to every miniature; True when the leader changed."""
        runners = self._runners
        counts = [runner.request(sampled) for runner in runners]
        lead = counts[self._leader_index]
        # By index: compiled, ``zip(..., strict=True)`` is a generic call with a keyword.
        for index in range(len(runners)):
            runner = runners[index]
            hits = counts[index]
            runner.score += hits
            runner.hits += hits
            runner.spread += (hits - lead) * (hits - lead)
        self._seen += len(sampled)
        self.sampled_blocks += len(sampled)
        if self._seen < self._window:
            return False
        self._seen = 0
        return self._evaluate()

    def _evaluate(self) -> bool:
        self.evaluations += 1
        runners = self._runners
        best = runners[0]
        current = runners[0]
        for runner in runners:
            if runner.score > best.score:
                best = runner
            if runner.name == self.leader:
                current = runner
        changed = False
        lead = best.score - current.score
        # The miniatures see the same requests: the lead must also exceed ``z`` standard
        # deviations of the paired per-request differences (sampling noise).
        noise = self._z * math.sqrt(best.spread)
        if best is not current and lead > max(self._margin * current.score, noise):
            if self._challenger == best.name:
                self.leader = best.name
                self._leader_index = runners.index(best)
                self.switches += 1
                self._challenger = ""
                changed = True
            else:
                self._challenger = best.name
        else:
            self._challenger = ""
        if self._rest_span > 0:
            self._rest(best if changed else current)
        for runner in runners:
            runner.score *= 0.5
            runner.spread *= 0.5
        return changed

    def _rest(self, current: _Runner) -> None:
        """Start a rest when ``current`` has led every other runner widely long enough."""
        wide = True
        bar = 1.0 + self._rest_lead
        for runner in self._runners:
            if runner is not current and current.score <= bar * runner.score:
                wide = False
        if not wide:
            self._calm = 0
            return
        self._calm += 1
        if self._calm >= self._rest_after:
            self.rest_keys = self._rest_span
            self.rests += 1
            self._calm = self._rest_after - 1  # one more wide lead after the rest

    def policy(self, name: str) -> CachePolicy | None:
        """The miniature of candidate ``name`` (the first of that name), or None."""
        for runner in self._runners:
            if runner.name == name:
                return runner.policy
        return None

    def scores(self) -> dict[str, float]:
        """Each candidate's decayed hit count (what the race compares)."""
        return {runner.name: runner.score for runner in self._runners}

    def hit_ratios(self) -> dict[str, float]:
        """Each candidate's hit ratio in miniature since the start."""
        n = max(1, self.sampled_blocks)
        return {runner.name: runner.hits / n for runner in self._runners}
