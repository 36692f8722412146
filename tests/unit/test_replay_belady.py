"""The Belady bound: exact on hand-checked cases, never below any policy's replay."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_offload.control.manager import CPUOffloadingManager
from kvcache_offload.control.policies.registry import available_cache_policies
from kvcache_offload.control.reuse_filter import FilterReusedOffloadingManager
from kvcache_offload.lab.belady import (
    belady_hits,
    next_use_positions,
)
from kvcache_offload.lab.driver import replay_trace
from kvcache_offload.lab.synth import synth_requests
from kvcache_offload.lab.trace import (
    Trace,
    TraceRequest,
    mooncake_key,
    trace_from_requests,
)


def _trace(requests: list[list[int]]) -> Trace:
    return trace_from_requests(
        TraceRequest(0.0, 512 * len(ids), 0, [mooncake_key(h) for h in ids]) for ids in requests
    )


def test_next_use_positions_point_at_the_next_access() -> None:
    assert next_use_positions([5, 6, 5, 5]) == [2, 4 + 6, 3, 4 + 5]


def test_belady_hand_checked_with_bypass() -> None:
    # Accesses a b c a b c (a, b, c = 0, 1, 2 after numbering), capacity 2.
    # a, b admitted; c is next used last of all -> not admitted; a, b hit; c misses.
    trace = _trace([[10, 11], [12], [10], [11], [12]])
    result = belady_hits(trace, 2)
    assert result.block_hits == 2
    assert result.blocks == 6
    assert result.token_hits == 2 * 512
    # LRU keeps a (the touch leaves a request's first key most recent), evicts b for c,
    # hits a, then misses b and c.
    assert replay_trace(CPUOffloadingManager(2, "lru"), trace).block_hits == 1


def test_belady_evicts_the_block_used_furthest_ahead() -> None:
    # Capacity 2: x y z x z y. At z, x is next used at 3 and y at 5: y goes.
    trace = _trace([[1], [2], [3], [1], [3], [2]])
    assert belady_hits(trace, 2).block_hits == 2  # x and z hit, y misses again


def test_belady_reaches_the_infinite_cache_rate_with_enough_capacity() -> None:
    trace = _trace([[1, 2], [1, 3], [1, 2, 4]])
    assert belady_hits(trace, 100).block_hits == trace.num_block_accesses - 4
    assert belady_hits(trace, 0).block_hits == 0


def test_belady_on_synthetic_trace_counts_only_prefix_hits() -> None:
    # On a chained trace every hit the bound counts lies in the request's leading cached run,
    # so the token hit count equals hits x block size (up to the partial last block cap).
    records = synth_requests(400, seed=1)
    trace = trace_from_requests(
        TraceRequest(0.0, r["input_length"], 0, [mooncake_key(h) for h in r["hash_ids"]])
        for r in records
    )
    for capacity in (5, 50, 500):
        result = belady_hits(trace, capacity)
        assert result.block_hits <= trace.num_block_accesses - trace.num_unique_blocks
        assert result.token_hits <= result.block_hits * 512


requests_strategy = st.lists(
    st.lists(st.integers(0, 12), min_size=1, max_size=6), min_size=1, max_size=40
)


@settings(max_examples=150, deadline=None)
@given(requests=requests_strategy, capacity=st.integers(1, 10), reuse=st.booleans())
def test_belady_is_never_below_any_policy(
    requests: list[list[int]], capacity: int, reuse: bool
) -> None:
    trace = _trace(requests)
    bound = belady_hits(trace, capacity).block_hits
    for policy in available_cache_policies():
        manager = CPUOffloadingManager(capacity, policy)
        if reuse:
            manager = FilterReusedOffloadingManager(manager, store_threshold=2)  # type: ignore[assignment]
        hits = replay_trace(manager, trace).block_hits
        assert hits <= bound, (policy, hits, bound)


@settings(max_examples=100, deadline=None)
@given(requests=requests_strategy, capacity=st.integers(1, 10))
def test_bypass_bound_is_at_least_the_admit_all_schedule(
    requests: list[list[int]], capacity: int
) -> None:
    trace = _trace(requests)
    assert (
        belady_hits(trace, capacity).block_hits
        >= belady_hits(trace, capacity, admit_all=True).block_hits
    )
