"""The CPU manager reproduces vLLM's classic behaviour call for call (reference section 10.1)."""

from __future__ import annotations

import pytest

from kvcache_offload import CPUOffloadingManager, OffloadingEvent, PrepareStoreOutput
from tests.unit._keys import key, key_ids, keys


def assert_store(
    out: PrepareStoreOutput | None, stored: list[int], ids: list[int], evicted: list[int]
) -> None:
    assert out is not None
    assert key_ids(out.keys_to_store) == stored
    assert out.store_spec.block_ids.tolist() == ids
    assert key_ids(out.evicted_keys) == evicted


def split_events(events: list[OffloadingEvent]) -> tuple[list[set[int]], list[set[int]]]:
    stores, evictions = [], []
    for ev in events:
        assert ev.medium == "CPU"
        (evictions if ev.removed else stores).append(set(key_ids(ev.keys)))
    return stores, evictions


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_already_stored_block_is_not_evicted_to_make_room_for_its_own_request(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    m.prepare_store(keys(1, 2))
    m.complete_store(keys(1, 2))
    m.touch(keys(1))  # 2 is now least recent
    out = m.prepare_store(keys(2, 3, 4, 5))
    assert_store(out, [3, 4, 5], [2, 3, 0], [1])
    m.complete_store(keys(2, 3, 4, 5))
    assert m.lookup(key(2)) is True


def test_lru_manager_full_scenario_matches_vllm() -> None:
    m = CPUOffloadingManager(4, "lru", enable_events=True)
    assert_store(m.prepare_store(keys(1, 2)), [1, 2], [0, 1], [])
    assert m.lookup(key(1)) is None and m.lookup(key(2)) is None
    assert list(m.take_events()) == []
    m.complete_store(keys(1, 2))
    stores, evictions = split_events(list(m.take_events()))
    assert stores == [{1, 2}] and evictions == []
    assert [m.lookup(k) for k in keys(1, 2, 3)] == [True, True, False]

    assert_store(m.prepare_store(keys(2, 3, 4, 5)), [3, 4, 5], [2, 3, 0], [1])
    assert split_events(list(m.take_events())) == ([], [{1}])
    # two slots needed, none free, only block 2 idle (3, 4, 5 are being written)
    assert m.prepare_store(keys(1, 6)) is None
    m.complete_store(keys(2, 3, 4, 5))
    assert [m.lookup(k) for k in keys(2, 3, 4, 5)] == [True] * 4
    assert [m.lookup(k) for k in keys(0, 1)] == [False, False]

    assert m.prepare_load(keys(2, 3)).block_ids.tolist() == [1, 2]
    assert m.prepare_store(keys(6, 7, 8)) is None  # 2 and 3 are being read
    m.complete_load(keys(2, 3))
    assert_store(m.prepare_store(keys(6, 7, 8)), [6, 7, 8], [3, 2, 1], [2, 3, 4])
    m.complete_store(keys(6, 7, 8))
    m.touch(keys(5, 6, 7))
    assert_store(m.prepare_store(keys(9)), [9], [1], [8])
    m.complete_store(keys(7, 9), success=False)
    assert m.lookup(key(7)) is True
    assert m.lookup(key(9)) is False

    stores, evictions = split_events(list(m.take_events()))
    assert stores == [{3, 4, 5}, {6, 7, 8}]
    assert evictions == [{2, 3, 4}, {8}]


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("order", [(1, 2, 3), (3, 1, 2), (2, 3, 1)])
def test_prepare_load_returns_block_ids_in_the_order_of_the_keys(policy: str, order: tuple) -> None:
    m = CPUOffloadingManager(4, policy)
    out = m.prepare_store(keys(1, 2, 3))
    assert out is not None
    slot = dict(zip(key_ids(out.keys_to_store), out.store_spec.block_ids.tolist(), strict=True))
    m.complete_store(keys(1, 2, 3))
    assert m.prepare_load(keys(*order)).block_ids.tolist() == [slot[i] for i in order]


def test_lookup_does_not_change_recency_but_touch_does() -> None:
    m = CPUOffloadingManager(2, "lru")
    m.prepare_store(keys(1, 2))
    m.complete_store(keys(1, 2))
    for _ in range(3):
        m.lookup(key(1))
    assert_store(m.prepare_store(keys(3)), [3], [0], [1])
    m.complete_store(keys(3))
    m.touch(keys(2))
    assert_store(m.prepare_store(keys(4)), [4], [0], [3])


def test_touch_in_reverse_order_makes_the_first_key_most_recent() -> None:
    m = CPUOffloadingManager(3, "lru")
    m.prepare_store(keys(1, 2, 3))
    m.complete_store(keys(1, 2, 3))
    m.touch(keys(1, 2, 3))  # recency now (least -> most): 3, 2, 1
    out = m.prepare_store(keys(4, 5))
    assert_store(out, [4, 5], [1, 2], [3, 2])


def test_fresh_slot_ids_ascend_before_freed_ids_are_reused_lifo() -> None:
    m = CPUOffloadingManager(5, "lru")
    assert_store(m.prepare_store(keys(1, 2, 3)), [1, 2, 3], [0, 1, 2], [])
    m.complete_store(keys(1, 2, 3), success=False)  # frees 0, 1, 2 in that order
    assert_store(m.prepare_store(keys(4, 5, 6, 7)), [4, 5, 6, 7], [3, 4, 2, 1], [])


def test_failed_store_frees_the_slot_and_emits_no_event() -> None:
    m = CPUOffloadingManager(2, "lru", enable_events=True)
    m.prepare_store(keys(1))
    m.complete_store(keys(1), success=False)
    assert m.lookup(key(1)) is False
    assert list(m.take_events()) == []
    assert m.stats().free == 2


def test_complete_store_is_idempotent_and_ignores_unknown_keys() -> None:
    m = CPUOffloadingManager(2, "lru", enable_events=True)
    m.prepare_store(keys(1))
    m.complete_store(keys(1, 9))
    m.complete_store(keys(1))
    stores, _ = split_events(list(m.take_events()))
    assert stores == [{1}]


def test_prepare_store_of_only_present_keys_returns_an_empty_output_not_none() -> None:
    m = CPUOffloadingManager(1, "lru")
    m.prepare_store(keys(1))
    out = m.prepare_store(keys(1))  # present, even while being written
    assert_store(out, [], [], [])


def test_duplicate_loads_need_as_many_completions() -> None:
    m = CPUOffloadingManager(1, "lru")
    m.prepare_store(keys(1))
    m.complete_store(keys(1))
    m.prepare_load(keys(1, 1))
    m.complete_load(keys(1))
    assert m.prepare_store(keys(2)) is None  # still pinned by the second load
    m.complete_load(keys(1))
    assert_store(m.prepare_store(keys(2)), [2], [0], [1])


def test_events_are_not_recorded_when_disabled() -> None:
    m = CPUOffloadingManager(1, "lru", enable_events=False)
    m.prepare_store(keys(1))
    m.complete_store(keys(1))
    m.prepare_store(keys(2))
    assert list(m.take_events()) == []


def test_reset_cache_drops_every_block_and_restarts_slot_ids() -> None:
    m = CPUOffloadingManager(3, "arc")
    m.prepare_store(keys(1, 2))
    m.complete_store(keys(1))
    m.reset_cache()
    assert [m.lookup(k) for k in keys(1, 2)] == [False, False]
    assert m.stats().free == 3 and m.stats().writing == 0
    assert_store(m.prepare_store(keys(3)), [3], [0], [])


def test_stats_track_blocks_by_state_evictions_and_rejections() -> None:
    m = CPUOffloadingManager(3, "lru")
    m.prepare_store(keys(1, 2, 3))
    m.complete_store(keys(1, 2))
    m.prepare_load(keys(1))
    s = m.stats()
    assert (s.free, s.writing, s.idle, s.reading) == (0, 1, 1, 1)
    assert m.prepare_store(keys(4, 5)) is None
    m.complete_store(keys(3))
    m.complete_load(keys(1))
    m.prepare_store(keys(4, 5))
    s = m.stats()
    assert s.evictions == 2 and s.rejected_stores == 1
    assert (s.free, s.writing, s.idle, s.reading) == (0, 2, 1, 0)


def test_zero_capacity_manager_refuses_every_store() -> None:
    m = CPUOffloadingManager(0, "lru")
    assert m.prepare_store(keys(1)) is None
    assert m.lookup(key(1)) is False


def test_a_policy_that_evicts_more_than_asked_loses_no_slot() -> None:
    # A third-party policy breaking "exactly n": the extra victim's slot stays usable.
    from kvcache_offload.control.policies import LRUCachePolicy

    class Greedy(LRUCachePolicy):
        def evict(self, n, protected):  # type: ignore[no-untyped-def]
            return super().evict(n + 1 if len(self) > n else n, protected)

    m = CPUOffloadingManager(4, Greedy)
    m.prepare_store(keys(0, 1, 2, 3))
    m.complete_store(keys(0, 1, 2, 3))
    out = m.prepare_store(keys(10))  # evicts two blocks for one key
    assert out is not None and key_ids(out.evicted_keys) == [0, 1]
    m.complete_store(keys(10))
    later = m.prepare_store(keys(20))  # the other freed slot: no eviction needed
    assert later is not None and later.evicted_keys == []
    slots = out.store_spec.block_ids.tolist() + later.store_spec.block_ids.tolist()
    assert sorted(slots) == [0, 1]
