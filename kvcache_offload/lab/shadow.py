"""Shadow policies: the hit ratio each candidate policy would have had, measured while serving.

An engine access observer (like :class:`~kvcache_offload.lab.mrc.MissRatioCurve`). Keys
are sampled spatially: a key is in the sample iff its CRC-32 falls below a threshold, so
every access of a sampled key is seen (SHARDS / miniature simulation, Waldspurger et al.
FAST'15 and ATC'17). Each candidate runs in a real :class:`CPUOffloadingManager` of
``rate x capacity`` blocks fed only the sampled keys, driven per lookup the way the
replay driver drives a full-size one: count the hits up to the first miss, ``touch``,
store the misses, ``touch`` again, complete the store. The hit ratio of a miniature
estimates that of the full-size cache under the same policy.

The live policy runs as one of the candidates, on the same sample, so operators compare
like with like (the live cache's own hit ratio is exported next to it). A candidate may be
``NAME+reuseN`` to put it behind the reuse filter, as in ``kvcache-offload replay``; with
``store_threshold`` >= 2 (the service's reuse filter) every candidate runs behind it.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvcache_offload.contracts.manager import (
    OffloadingManager,
    ReqContext,
)
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError
from kvcache_offload.lab.sweep import make_manager

__all__ = ["ShadowPolicies", "ShadowStats"]

_HASH_SPACE = 1 << 32
_CTX = ReqContext("shadow")


@dataclass(frozen=True)
class ShadowStats:
    """Cumulative counts since the last (re)sizing: hit blocks per candidate and sampled
    blocks looked up (the same for every candidate)."""

    live: str
    hit_blocks: dict[str, int]
    sampled_blocks: int
    rate: float

    def hit_ratio(self) -> dict[str, float]:
        n = self.sampled_blocks
        return {name: (hits / n if n else 0.0) for name, hits in self.hit_blocks.items()}


class _Miniature:
    """One candidate policy at ``rate x capacity`` blocks, fed the sampled keys."""

    __slots__ = ("hits", "manager")

    def __init__(self, manager: OffloadingManager) -> None:
        self.manager = manager
        self.hits = 0

    def request(self, keys: list[OffloadKey]) -> None:
        manager = self.manager
        hits = 0
        for key in keys:
            if manager.lookup(key, _CTX) is not True:
                break
            hits += 1
        self.hits += hits
        manager.touch(keys, _CTX)
        if hits == len(keys):
            return
        out = manager.prepare_store(keys[hits:], _CTX)
        if out is not None and out.keys_to_store:
            manager.touch(keys, _CTX)
            manager.complete_store(out.keys_to_store, _CTX)


class ShadowPolicies:
    """Engine access observer running ``policies`` (plus ``live``) on a hashed key sample.

    ``sample_blocks`` is the size of every miniature cache: the sampling rate is
    ``sample_blocks / capacity`` (at most 1), so cost and memory stay bounded whatever the
    tier's size, while a few thousand blocks keep the estimate within about a point of the
    full-size hit ratio. Nothing is simulated until :meth:`bind_capacity` is called (the
    engine does so with its manager's size).
    """

    def __init__(
        self,
        policies: Sequence[str],
        live: str,
        *,
        store_threshold: int = 0,
        sample_blocks: int = 2048,
    ) -> None:
        if sample_blocks < 1:
            raise ConfigError(f"sample_blocks must be >= 1, got {sample_blocks!r}")
        names = list(dict.fromkeys([live, *policies]))
        # The service's reuse filter sits in front of whichever policy runs: so in the shadows.
        self._reuse_threshold = store_threshold if store_threshold >= 2 else None
        self.live = live
        self.policies: tuple[str, ...] = tuple(names)
        self.sample_blocks = sample_blocks
        self._capacity = 0
        self._threshold = 0
        self._rate = 0.0
        self._minis: dict[str, _Miniature] = {}
        self._sampled = 0
        # Fail at construction on an unknown policy name, not at the first lookup.
        for name in names:
            self._make(name, 1)

    def _make(self, spec: str, capacity: int) -> OffloadingManager:
        return make_manager(spec, capacity, self._reuse_threshold)

    def bind_capacity(self, capacity_blocks: int) -> None:
        """Size the miniatures for a tier of ``capacity_blocks`` blocks and start over."""
        self._capacity = max(0, int(capacity_blocks))
        if self._capacity == 0:
            self._rate, self._threshold, self._minis = 0.0, 0, {}
            self._sampled = 0
            return
        rate = min(1.0, self.sample_blocks / self._capacity)
        self._rate = rate
        self._threshold = max(1, round(rate * _HASH_SPACE))
        mini_capacity = max(1, round(rate * self._capacity))
        self._minis = {name: _Miniature(self._make(name, mini_capacity)) for name in self.policies}
        self._sampled = 0

    def reset(self) -> None:
        """Forget everything (the cache was reset)."""
        self.bind_capacity(self._capacity)

    # -- observer interface --------------------------------------------------------------

    def on_lookup(self, keys: Sequence[OffloadKey], hits: int) -> None:
        """One request: the sampled keys, in prefix order, go to every miniature."""
        if not self._minis or not keys:
            return
        threshold = self._threshold
        crc = zlib.crc32
        sampled = [key for key in keys if crc(key) < threshold]
        if not sampled:
            return
        if len(sampled) > 1:
            sampled = list(dict.fromkeys(sampled))
        self._sampled += len(sampled)
        for mini in self._minis.values():
            mini.request(sampled)

    def on_store(self, keys: Sequence[OffloadKey]) -> None:
        """Stores follow the lookup that already stored the same keys in the miniatures."""

    # -- results -------------------------------------------------------------------------

    def shadow_stats(self) -> ShadowStats:
        return ShadowStats(
            live=self.live,
            hit_blocks={name: mini.hits for name, mini in self._minis.items()},
            sampled_blocks=self._sampled,
            rate=self._rate,
        )

    @property
    def sample_rate(self) -> float:
        return self._rate
