"""Access observers: who sees the lookup and store stream, sorted once by capability.

The service attaches the miss-ratio-curve sampler, the shadow policies and the request
recorder; embedded users may attach their own. Each observer implements whichever
capabilities of :mod:`kvcache_offload.contracts.capabilities` it needs. One that raises is
logged and otherwise ignored: observing never breaks serving.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from kvcache_offload.contracts.capabilities import (
    CapacityObserver,
    LookupObserver,
    MissRatioReporter,
    ShadowReporter,
    ShadowSnapshot,
    StoreObserver,
)
from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["AccessObservers"]

logger = logging.getLogger(__name__)


class AccessObservers:
    """The engine's observers, each filed under the capabilities it has."""

    def __init__(self, observers: Sequence[object]) -> None:
        self.all = list(observers)
        self._lookup = [o for o in self.all if isinstance(o, LookupObserver)]
        self._store = [o for o in self.all if isinstance(o, StoreObserver)]
        self._capacity = [o for o in self.all if isinstance(o, CapacityObserver)]
        self._mrc = [o for o in self.all if isinstance(o, MissRatioReporter)]
        self._shadow = [o for o in self.all if isinstance(o, ShadowReporter)]

    def bind_capacity(self, num_blocks: int) -> None:
        for obs in self._capacity:
            try:
                obs.bind_capacity(num_blocks)
            except Exception:
                logger.exception("bind_capacity of observer %r raised; ignored", obs)

    def on_lookup(self, keys: Sequence[OffloadKey], hits: int) -> None:
        for obs in self._lookup:
            try:
                obs.on_lookup(keys, hits)
            except Exception:
                logger.exception("access observer %r raised; ignored", obs)

    def on_store(self, keys: Sequence[OffloadKey]) -> None:
        for obs in self._store:
            try:
                obs.on_store(keys)
            except Exception:
                logger.exception("access observer %r raised; ignored", obs)

    def mrc_stats(self, capacity_blocks: int) -> tuple[Mapping[float, float], int] | None:
        """The first miss-ratio reporter's estimate, or None when there is none."""
        for obs in self._mrc:
            try:
                return obs.mrc_stats(capacity_blocks)
            except Exception:
                logger.exception("mrc_stats of observer %r raised; ignored", obs)
        return None

    def shadow_stats(self) -> ShadowSnapshot | None:
        """The first shadow simulation's counts, or None when there is none."""
        for obs in self._shadow:
            try:
                return obs.shadow_stats()
            except Exception:
                logger.exception("shadow_stats of observer %r raised; ignored", obs)
        return None

    @property
    def watches_lookups(self) -> bool:
        return bool(self._lookup)

    @property
    def watches_stores(self) -> bool:
        return bool(self._store)
