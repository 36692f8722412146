"""ARC as vLLM drives it, plus the fall-back-to-T1 fix (vLLM #55461)."""

from __future__ import annotations

from kvcache_offload import CPUOffloadingManager
from kvcache_offload.control.policies import (
    ARCCachePolicy,
    BlockStatus,
)
from kvcache_offload.control.policies.arc import B1, B2, T1, T2
from tests.unit._keys import key, key_ids, keys


def arc(m: CPUOffloadingManager) -> ARCCachePolicy:
    policy = m.policy
    assert isinstance(policy, ARCCachePolicy)
    return policy


def filled(capacity: int = 4, n: int = 4) -> CPUOffloadingManager:
    m = CPUOffloadingManager(capacity, "arc", enable_events=True)
    m.prepare_store(keys(*range(1, n + 1)))
    m.complete_store(keys(*range(1, n + 1)))
    return m


def test_completed_blocks_sit_in_t1_until_touched_then_move_to_t2() -> None:
    m = filled(4, 2)
    assert set(key_ids(arc(m).keys_in(T1))) == {1, 2} and not arc(m).keys_in(T2)
    m.touch(keys(1))
    assert key_ids(arc(m).keys_in(T2)) == [1]


def test_touching_a_block_being_written_does_not_promote_it() -> None:
    m = CPUOffloadingManager(4, "arc")
    m.prepare_store(keys(1))
    m.touch(keys(1))
    assert key_ids(arc(m).keys_in(T1)) == [1] and not arc(m).keys_in(T2)


def test_blocks_being_loaded_are_not_evicted_until_the_load_completes() -> None:
    m = filled()
    assert m.prepare_load(keys(2, 3)).block_ids.tolist() == [1, 2]
    assert m.prepare_store(keys(5, 6, 7)) is None
    m.complete_load(keys(2, 3))
    out = m.prepare_store(keys(5, 6, 7))
    assert out is not None and len(out.evicted_keys) >= 1


def test_ghost_hit_in_b1_raises_the_t1_target() -> None:
    m = filled(2, 2)
    m.prepare_store(keys(3))
    assert key_ids(arc(m).keys_in(B1)) == [1]
    before = arc(m).target_t1_size
    m.touch(keys(1))
    assert arc(m).target_t1_size > before


def test_eviction_takes_t1_lru_when_t1_exceeds_its_target() -> None:
    m = filled()
    m.touch(keys(3, 4))
    arc(m).target_t1_size = 1
    out = m.prepare_store(keys(5))
    assert out is not None and key_ids(out.evicted_keys) == [1]
    assert key(1) in arc(m).keys_in(B1) and key(5) in arc(m).keys_in(T1)


def test_ghost_lists_stay_bounded_by_capacity() -> None:
    m = filled(2, 2)
    for i in range(3, 20):
        m.prepare_store(keys(i))
        m.complete_store(keys(i))
        m.touch(keys(i))
    assert len(arc(m).keys_in(B1)) <= 2 and len(arc(m).keys_in(B2)) <= 2
    assert 0 <= arc(m).target_t1_size <= 2


def test_touch_order_decides_which_t1_block_is_evicted() -> None:
    m = filled()
    m.touch(keys(3, 4))
    m.touch(keys(1, 3, 4))
    assert len(arc(m).keys_in(T1)) == 1 and len(arc(m).keys_in(T2)) == 3
    out = m.prepare_store(keys(5))
    assert out is not None and key_ids(out.evicted_keys) == [2]
    assert out.store_spec.block_ids.tolist() == [1]


def test_failed_store_leaves_the_evicted_key_in_b1() -> None:
    m = filled()
    out = m.prepare_store(keys(5))
    assert out is not None and len(out.evicted_keys) == 1
    m.complete_store(keys(5), success=False)
    assert m.lookup(key(5)) is False
    assert key(5) not in arc(m).keys_in(T1) and key(5) not in arc(m).keys_in(T2)
    assert out.evicted_keys[0] in arc(m).keys_in(B1)


def test_full_scenario_keeps_frequently_used_blocks() -> None:
    m = CPUOffloadingManager(4, "arc", enable_events=True)
    m.prepare_store(keys(1, 2))
    m.complete_store(keys(1, 2))
    out = m.prepare_store(keys(3, 4, 5))
    assert out is not None and len(out.evicted_keys) == 1
    m.complete_store(keys(3, 4, 5))
    m.touch(keys(2, 3))
    assert set(key_ids(arc(m).keys_in(T2))) == {2, 3}
    m.prepare_store(keys(6))
    m.complete_store(keys(6))
    assert m.lookup(key(2)) is True and m.lookup(key(3)) is True
    assert list(m.take_events())


def test_eviction_falls_back_to_t1_when_t2_has_nothing_evictable() -> None:
    # vLLM #55461: |T1| < target and every T2 block pinned must not fail the store.
    m = filled()
    m.touch(keys(3, 4))  # T1 = {1, 2}, T2 = {3, 4}
    m.prepare_load(keys(3, 4))  # T2 pinned
    arc(m).target_t1_size = 4  # T1 below target: classic ARC would pick T2 only
    out = m.prepare_store(keys(5))
    assert out is not None and key_ids(out.evicted_keys) == [1]


def test_eviction_is_one_pass_not_a_rescan_per_victim() -> None:
    # Many pinned blocks at the LRU end: evicting k victims must touch each at most once.
    policy = ARCCachePolicy(cache_capacity=10_000)
    pinned = 5_000
    for i in range(pinned + 100):
        block = BlockStatus(i)
        block.ref_cnt = 1 if i < pinned else 0
        policy.insert(key(i), block)
    victims = policy.evict(50, protected=set())
    assert victims is not None and len(victims) == 50
    # T1 holds everything; the pinned head is crossed once, not once per victim.
    assert policy.scanned <= pinned + 50 + 1


def test_a_dropped_or_cleared_arc_policy_frees_its_nodes() -> None:
    # Compiled, ARC's nodes are invisible to the cycle collector: the rings must be cut.
    import gc
    import tracemalloc

    def fill(policy: ARCCachePolicy) -> None:
        for i in range(6_000):
            block = BlockStatus(i)
            block.ref_cnt = 0
            policy.insert(key(i), block)
        victims = policy.evict(3_000, protected=set())  # 3,000 ghosts in B1
        assert victims is not None and len(policy.keys_in(B1)) == 3_000

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            policy = ARCCachePolicy(cache_capacity=6_000)
            fill(policy)
            del policy
        kept = ARCCachePolicy(cache_capacity=6_000)
        fill(kept)
        kept.clear()
        gc.collect()
        leaked = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert leaked < 256 * 1024, f"{leaked} bytes still allocated"
