"""A failing tier is backed off one step per outage, not one step per call it caught.

A promotion fetches its blocks in several concurrent calls; when the tier is down all of them
fail together. Counting each as a new failure would back the tier off for the longest time at
once, and a tier that comes back would be left unused for seconds.
"""

from __future__ import annotations

from kvcache_offload.tiers._tier_health import TierHealth


def test_calls_failing_together_back_the_tier_off_one_step() -> None:
    health = TierHealth()
    for _ in range(16):
        health.failed(100.0)
    assert health.backoff_s == 0.1
    assert health.counts.errors == 16
    assert not health.available(100.05)
    assert health.available(100.1)


def test_a_failure_after_the_back_off_ended_doubles_it() -> None:
    health = TierHealth()
    health.failed(100.0)
    health.failed(100.2)
    assert health.backoff_s == 0.2
    health.succeeded()
    health.failed(200.0)
    assert health.backoff_s == 0.1
