"""Back-off and slowness of one secondary tier, as the tier set judges it.

A tier that fails is skipped for a while (0.1 s, doubling up to 5 s with each failure after
a back-off ended, reset by a success). A
tier whose writes get slow (moving average above 1 s) has writes dropped until it is fast
again (below 0.5 s), with one probe write a second to find out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache_offload.tiers.base import TierStats

__all__ = ["TierHealth"]

_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 5.0
_SLOW_ON_S = 1.0
_SLOW_OFF_S = 0.5
_SLOW_PROBE_S = 1.0
_EMA_WEIGHT = 0.2


@dataclass
class TierHealth:
    """Back-off state of one tier, and the counters the tier set keeps for it."""

    down_until: float = 0.0
    backoff_s: float = 0.0
    write_ema_s: float = 0.0
    slow: bool = False
    last_probe: float = 0.0
    counts: TierStats = field(default_factory=lambda: TierStats("", ""))
    """The counters the tier set keeps itself (hits, misses, errors, writes_dropped)."""

    def available(self, now: float) -> bool:
        return now >= self.down_until

    def failed(self, now: float) -> None:
        """One call failed. Calls that were already in flight when the tier was backed off
        (the chunks of one promotion, concurrent reads) count as errors but do not double
        the back-off again: one outage is one step, however many calls it caught."""
        self.counts.errors += 1
        if now < self.down_until:
            return
        self.backoff_s = min(max(self.backoff_s * 2, _BACKOFF_FIRST_S), _BACKOFF_MAX_S)
        self.down_until = now + self.backoff_s

    def succeeded(self) -> None:
        self.backoff_s = 0.0
        self.down_until = 0.0

    def accepts_write(self, now: float) -> bool:
        if not self.available(now):
            return False
        if self.slow and now - self.last_probe < _SLOW_PROBE_S:
            return False
        self.last_probe = now
        return True

    def wrote(self, seconds: float) -> None:
        self.write_ema_s += _EMA_WEIGHT * (seconds - self.write_ema_s)
        if self.write_ema_s > _SLOW_ON_S:
            self.slow = True
        elif self.write_ema_s < _SLOW_OFF_S:
            self.slow = False
