"""The replay driver calls the manager like vLLM's scheduler and counts exactly."""

from __future__ import annotations

from kvcache_offload.control.manager import CPUOffloadingManager
from kvcache_offload.control.reuse_filter import FilterReusedOffloadingManager
from kvcache_offload.lab.driver import replay_trace
from kvcache_offload.lab.synth import synth_requests
from kvcache_offload.lab.trace import (
    TraceRequest,
    mooncake_key,
    trace_from_requests,
)


def _trace(*requests: tuple[list[int], int]):  # type: ignore[no-untyped-def]
    return trace_from_requests(
        TraceRequest(float(i), length, 0, [mooncake_key(h) for h in ids])
        for i, (ids, length) in enumerate(requests)
    )


def test_lru_counts_on_a_hand_checked_trace() -> None:
    # Capacity 2. R1 stores a, b (LRU order after the touches: b, a).
    # R2 hits a, stores c evicting b. R3 hits a, stores b evicting c.
    a, b, c = 1, 2, 3
    trace = _trace(([a, b], 1000), ([a, c], 1000), ([a, b], 1000))
    manager = CPUOffloadingManager(2, "lru")
    counts = replay_trace(manager, trace)
    assert counts.requests == 3
    assert counts.blocks == 6
    assert counts.block_hits == 2
    assert counts.tokens == 3000
    assert counts.token_hits == 1024
    assert counts.evictions == 2
    assert counts.stored_blocks == 4
    assert counts.rejected_stores == 0
    assert counts.deferred_requests == 0
    # R1: lookup, touch, prepare_store, touch, complete_store.
    # R2, R3: 2 lookups, touch, prepare/complete_load, prepare_store, touch, complete_store.
    assert counts.manager_ops == 5 + 8 * 2
    stats = manager.stats()
    assert stats.evictions == 2
    assert stats.idle == 2 and stats.writing == 0 and stats.reading == 0


def test_token_hits_are_capped_by_input_length() -> None:
    trace = _trace(([1, 2], 700), ([1, 2], 700))
    counts = replay_trace(CPUOffloadingManager(10, "lru"), trace)
    assert counts.block_hits == 2
    assert counts.token_hits == 700


def test_only_the_leading_run_of_cached_keys_hits() -> None:
    # 2 is cached, but 5 (before it) is not: a prefix lookup stops at 5.
    trace = _trace(([2], 512), ([5, 2], 1024))
    counts = replay_trace(CPUOffloadingManager(10, "lru"), trace)
    assert counts.block_hits == 0
    assert counts.stored_blocks == 2  # 5 stored, 2 already present


def test_store_larger_than_the_cache_is_rejected_and_counted() -> None:
    trace = _trace(([1, 2, 3], 1536), ([1], 512))
    counts = replay_trace(CPUOffloadingManager(2, "lru"), trace)
    assert counts.rejected_stores == 1
    assert counts.block_hits == 0
    assert counts.stored_blocks == 1


def test_reuse_filter_delays_stores_until_offered_twice() -> None:
    trace = _trace(([1, 2], 1024), ([1, 2], 1024), ([1, 2], 1024))
    manager = FilterReusedOffloadingManager(CPUOffloadingManager(8, "lru"), store_threshold=2)
    counts = replay_trace(manager, trace)
    assert counts.block_hits == 2  # only the third request hits
    assert counts.stored_blocks == 2


def test_every_registered_policy_replays_the_synthetic_trace() -> None:
    from kvcache_offload.control.policies.registry import available_cache_policies

    trace = trace_from_requests(
        TraceRequest(r["timestamp"], r["input_length"], 0, [mooncake_key(h) for h in r["hash_ids"]])
        for r in synth_requests(300, seed=3)
    )
    for policy in available_cache_policies():
        manager = CPUOffloadingManager(max(1, trace.num_unique_blocks // 10), policy)
        counts = replay_trace(manager, trace)
        assert 0 <= counts.block_hits <= counts.blocks
        stats = manager.stats()
        assert stats.writing == 0 and stats.reading == 0, policy
        assert counts.evictions == stats.evictions, policy


def test_progress_reports_every_request_once() -> None:
    trace = trace_from_requests(
        TraceRequest(0.0, 512, 0, [mooncake_key(i % 7)]) for i in range(3000)
    )
    seen: list[int] = []
    replay_trace(CPUOffloadingManager(4, "lru"), trace, progress=seen.append)
    assert sum(seen) == 3000


def test_without_the_second_touch_new_blocks_keep_insertion_order() -> None:
    # Capacity 3: R1 stores 1, 2, 3. With vLLM's touch after the store, 1 is most recent and
    # 3 goes first; without it, insertion order leaves 1 least recent.
    trace = _trace(([1, 2, 3], 1536), ([4], 512), ([1], 512), ([3], 512))
    with_touch = replay_trace(CPUOffloadingManager(3, "lru"), trace)
    without = replay_trace(CPUOffloadingManager(3, "lru"), trace, touch_after_store=False)
    assert with_touch.block_hits == 1  # 1 hits, 3 was evicted for 4
    assert without.block_hits == 1  # 1 was evicted for 4, then 3 hits
    assert with_touch.manager_ops - without.manager_ops == 3  # one touch per storing request


def test_a_block_still_being_written_defers_the_request_and_is_not_loaded() -> None:
    manager = CPUOffloadingManager(8, "lru")
    manager.prepare_store([mooncake_key(1)])  # never completed: lookup answers None
    trace = _trace(([1, 2], 1024))
    counts = replay_trace(manager, trace)
    assert counts.deferred_requests == 1
    assert counts.block_hits == 0
    assert counts.stored_blocks == 1  # block 2; block 1 is already present
    assert manager.stats().reading == 0


def test_callbacks_see_each_request_and_its_stores_and_can_act_between_requests() -> None:
    # A caller discards what R1 stored before R2 runs: R2 then misses where it would hit.
    a, b, c = 1, 2, 3
    trace = _trace(([a, b], 1024), ([a, c], 1024), ([c], 512))
    manager = CPUOffloadingManager(10, "lru")
    seen: list[int] = []
    stored: dict[int, list[object]] = {}

    def before(index: int) -> None:
        seen.append(index)
        if index == 1:
            manager.discard(stored[0])

    counts = replay_trace(
        manager, trace, before_request=before, on_stored=lambda i, ks: stored.update({i: ks})
    )
    assert seen == [0, 1, 2]
    assert stored == {0: [mooncake_key(a), mooncake_key(b)], 1: [mooncake_key(a), mooncake_key(c)]}
    assert counts.block_hits == 1  # only R3's c; R2's a was discarded before it asked
