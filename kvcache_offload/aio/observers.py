"""Access observers: who sees the lookup and store stream, sorted once by capability.

The service attaches the miss-ratio-curve sampler, the shadow policies and the request
recorder; embedded users may attach their own. Each observer implements whichever
capabilities of :mod:`kvcache_offload.contracts.capabilities` it needs. One that raises is
logged and otherwise ignored: observing never breaks serving.

The estimators (observers that report a miss-ratio curve or shadow hit ratios) are the
expensive ones: simulating four policies and a reuse-distance tree per key can cost more than
the lookup it observes. With a ``budget`` (the service gives 0.1) they run off the request
path, on the event loop, within that share of the loop's time: a lookup only queues its keys.
Without one (the default for embedded engines) every observer is called inline. When requests come
faster than the budget allows, whole requests are left out of the estimates (counted in
``dropped_requests``), so a saturated service answers at the speed it would without them; the
estimates then describe a sample of the requests in time. Asking for the estimates first
catches up on everything queued. Other observers (the request recorder) see every request, inline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
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

_MAX_QUEUED = 4096
"""Requests waiting for the estimators; beyond this the newest are left out."""
_SLICE_S = 0.0005
"""Longest stretch the estimators run before the loop gets control back (at least one
request is fed: ~0.3-0.6 ms of CPU for 64 keys through the MRC and four shadow policies).
Every request that is ready meanwhile waits for the slice, so it adds to the served tail;
2 ms slices added up to ~2.5 ms."""


def _is_estimator(obs: object) -> bool:
    return isinstance(obs, MissRatioReporter | ShadowReporter)


class AccessObservers:
    """The engine's observers, each filed under the capabilities it has."""

    def __init__(self, observers: Sequence[object], *, budget: float | None = None) -> None:
        self.all = list(observers)
        self.budget = budget or 0.0
        lookup = [o for o in self.all if isinstance(o, LookupObserver)]
        store = [o for o in self.all if isinstance(o, StoreObserver)]

        def deferred(o: object) -> bool:
            return budget is not None and _is_estimator(o)

        self._lookup = [o for o in lookup if not deferred(o)]
        self._store = [o for o in store if not deferred(o)]
        self._est_lookup = [o for o in lookup if deferred(o)]
        self._est_store = [o for o in store if deferred(o)]
        # Plain attributes, not properties: the engine reads one per lookup or store.
        self.watches_lookups = bool(self._lookup or self._est_lookup)
        self.watches_stores = bool(self._store or self._est_store)
        self._capacity = [o for o in self.all if isinstance(o, CapacityObserver)]
        self._mrc = [o for o in self.all if isinstance(o, MissRatioReporter)]
        self._shadow = [o for o in self.all if isinstance(o, ShadowReporter)]
        self._queue: deque[tuple[list[OffloadKey], int | None]] = deque()
        self._scheduled = False
        self._busy_s = 0.0
        self._since = time.perf_counter()
        self.dropped_requests = 0

    def bind_capacity(self, num_blocks: int) -> None:
        for obs in self._capacity:
            try:
                obs.bind_capacity(num_blocks)
            except Exception:
                logger.exception("bind_capacity of observer %r raised; ignored", obs)

    # -- the access stream ------------------------------------------------------------------

    def on_lookup(self, keys: Sequence[OffloadKey], hits: int) -> None:
        for obs in self._lookup:
            try:
                obs.on_lookup(keys, hits)
            except Exception:
                logger.exception("access observer %r raised; ignored", obs)
        if self._est_lookup:
            self._enqueue(list(keys), hits)

    def on_store(self, keys: Sequence[OffloadKey]) -> None:
        for obs in self._store:
            try:
                obs.on_store(keys)
            except Exception:
                logger.exception("access observer %r raised; ignored", obs)
        if self._est_store:
            self._enqueue(list(keys), None)

    def _enqueue(self, keys: list[OffloadKey], hits: int | None) -> None:
        if len(self._queue) >= _MAX_QUEUED:
            self.dropped_requests += 1
            return
        self._queue.append((keys, hits))
        self._schedule(0.0)

    def _schedule(self, delay: float) -> None:
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): catch up at once
            self.catch_up()
            return
        self._scheduled = True
        if delay > 0:
            loop.call_later(delay, self._drain)
        else:
            loop.call_soon(self._drain)

    def _drain(self) -> None:
        """Feed queued requests to the estimators, within the budget of loop time."""
        self._scheduled = False
        now = time.perf_counter()
        allowed = self.budget * (now - self._since) - self._busy_s
        if allowed <= 0:
            # Over budget: shed what cannot be caught up soon, look again a little later.
            while len(self._queue) > _MAX_QUEUED // 2:
                self._queue.popleft()
                self.dropped_requests += 1
            if self._queue:
                self._schedule(min(0.05, -allowed / self.budget + 0.001))
            return
        deadline = now + min(_SLICE_S, allowed)
        while self._queue and time.perf_counter() < deadline:
            self._feed(*self._queue.popleft())
        end = time.perf_counter()
        self._busy_s += end - now
        if end - self._since > 10.0:  # the budget looks back about ten seconds
            self._busy_s *= 0.5
            self._since = end - (end - self._since) * 0.5
        if self._queue:
            self._schedule(0.0)

    def _feed(self, keys: list[OffloadKey], hits: int | None) -> None:
        targets = self._est_lookup if hits is not None else self._est_store
        for obs in targets:
            try:
                if hits is not None:
                    obs.on_lookup(keys, hits)  # type: ignore[union-attr]
                else:
                    obs.on_store(keys)  # type: ignore[union-attr]
            except Exception:
                logger.exception("access observer %r raised; ignored", obs)

    def catch_up(self) -> None:
        """Feed everything queued now, whatever the budget (before reading the estimates)."""
        while self._queue:
            self._feed(*self._queue.popleft())

    # -- the estimates ----------------------------------------------------------------------

    def mrc_stats(self, capacity_blocks: int) -> tuple[Mapping[float, float], int] | None:
        """The first miss-ratio reporter's estimate, or None when there is none."""
        if not self._mrc:
            return None
        self.catch_up()
        for obs in self._mrc:
            try:
                return obs.mrc_stats(capacity_blocks)
            except Exception:
                logger.exception("mrc_stats of observer %r raised; ignored", obs)
        return None

    def shadow_stats(self) -> ShadowSnapshot | None:
        """The first shadow simulation's counts, or None when there is none."""
        if not self._shadow:
            return None
        self.catch_up()
        for obs in self._shadow:
            try:
                return obs.shadow_stats()
            except Exception:
                logger.exception("shadow_stats of observer %r raised; ignored", obs)
        return None
