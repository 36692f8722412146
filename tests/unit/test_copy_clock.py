"""CopyClock: predicted ends of CUDA copies, from the GPU time of earlier ones."""

from __future__ import annotations

import pytest

from kvcache_offload.aio.copy_clock import CopyClock


def test_nothing_is_predicted_before_a_copy_was_measured() -> None:
    clock = CopyClock()
    assert clock.expect("CPU", 8, now=10.0) == 10.0


def test_a_copy_waits_behind_the_copies_of_its_direction() -> None:
    clock = CopyClock()
    clock.observe("CPU", 4, 0.004)  # 1 ms per block
    assert clock.expect("CPU", 2, now=10.0) == pytest.approx(10.002)
    assert clock.expect("CPU", 3, now=10.001) == pytest.approx(10.005)  # queued behind
    assert clock.expect("GPU", 3, now=10.001) == 10.001  # the other direction: unmeasured


def test_idle_forgets_the_queue_and_keeps_the_rate() -> None:
    clock = CopyClock()
    clock.observe("CPU", 1, 0.001)
    clock.expect("CPU", 10, now=0.0)
    clock.idle()
    assert clock.expect("CPU", 1, now=1.0) == pytest.approx(1.001)


def test_the_rate_follows_new_measurements_and_ignores_empty_ones() -> None:
    clock = CopyClock(weight=0.5)
    clock.observe("CPU", 1, 0.002)
    clock.observe("CPU", 1, 0.004)
    clock.observe("CPU", 0, 1.0)
    clock.observe("CPU", 1, 0.0)
    assert clock.seconds_per_block("CPU") == pytest.approx(0.003)
