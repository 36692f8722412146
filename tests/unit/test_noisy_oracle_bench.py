"""research.noisy_oracle: MIN driven by predicted return times, on the shipped sample trace."""

from __future__ import annotations

import pytest

from kvcache_offload.lab.belady import belady_hits, next_use_positions
from kvcache_offload.lab.trace import load_trace, sample_trace_path
from research.noisy_oracle import measure, noisy_next_use


def test_exact_predictions_are_min_and_noise_never_beats_it() -> None:
    trace = load_trace(sample_trace_path())
    unique = len({k for ks in trace.keys for k in ks})
    capacity = max(1, unique // 20)
    (row,) = measure(trace, [("5%", capacity)], [0.0, 1.0, 3.0], seed=1)
    assert row["noisy"][0.0]["hit_rate"] == pytest.approx(row["belady"])
    assert row["noisy"][0.0]["gap_share"] == pytest.approx(1.0)
    assert all(row["noisy"][s]["hit_rate"] <= row["belady"] + 1e-9 for s in (1.0, 3.0))
    # Far worse predictions lose most of what MIN knew.
    assert row["noisy"][3.0]["hit_rate"] < row["noisy"][0.0]["hit_rate"]


def test_predictions_keep_their_order_of_accesses_and_are_checked() -> None:
    accesses = [1, 2, 1, 3, 2, 1]
    assert noisy_next_use(accesses, 0.0, seed=0) == next_use_positions(accesses)
    noisy = noisy_next_use(accesses, 1.0, seed=0)
    assert len(noisy) == len(accesses) and all(u > i for i, u in enumerate(noisy))
    with pytest.raises(ValueError, match="sigma"):
        noisy_next_use(accesses, -1.0, seed=0)
    trace = load_trace(sample_trace_path())
    with pytest.raises(ValueError, match="predicted_next_use"):
        belady_hits(trace, 10, predicted_next_use=[0, 1])
