"""The reuse filter stores a block only after it was offered ``store_threshold`` times."""

from __future__ import annotations

import pytest

from kvcache_offload import ConfigError, CPUOffloadingManager, FilterReusedOffloadingManager
from tests.unit._keys import key, key_ids, keys


def make(threshold: int = 2, tracker: int = 3) -> FilterReusedOffloadingManager:
    return FilterReusedOffloadingManager(
        CPUOffloadingManager(4, "lru", enable_events=True), threshold, tracker
    )


def test_a_long_cold_prefix_becomes_eligible_after_threshold_offers() -> None:
    # vLLM #52227: counting offers (not lookups) makes every block of an N-block prefix
    # eligible after two requests, not after 2N+1.
    m = make(tracker=100)
    first = m.prepare_store(keys(1, 2, 3, 4))
    assert first is not None and first.keys_to_store == []
    assert m.stores_skipped == 4
    second = m.prepare_store(keys(1, 2, 3, 4))
    assert second is not None and key_ids(second.keys_to_store) == [1, 2, 3, 4]


def test_lookups_do_not_count_towards_the_threshold() -> None:
    m = make()
    for _ in range(5):
        assert m.lookup(key(1)) is False
    out = m.prepare_store(keys(1))
    assert out is not None and out.keys_to_store == []


def test_tracker_forgets_the_least_recently_offered_key_when_full() -> None:
    m = make(tracker=3)
    m.prepare_store(keys(1, 2))
    m.prepare_store(keys(3, 4))  # 1 falls out of the 3-entry tracker
    assert key(1) not in m.counts and key(2) in m.counts
    out = m.prepare_store(keys(1))
    assert out is not None and out.keys_to_store == []  # count restarted at 1


def test_already_offloaded_keys_stay_protected_through_the_filter() -> None:
    m = make(tracker=100)
    m.prepare_store(keys(1, 2))
    m.prepare_store(keys(1, 2))
    m.complete_store(keys(1, 2))
    m.touch(keys(1))
    for i in (3, 4):
        m.prepare_store(keys(i))
    m.prepare_store(keys(3, 4))
    m.complete_store(keys(3, 4))
    # Cache full: {1, 2, 3, 4}. Offering [2, 5, 5'] must not evict 2 to make room.
    m.prepare_store(keys(5, 6))
    out = m.prepare_store(keys(2, 5, 6))
    assert out is not None
    assert key(2) not in out.evicted_keys
    assert key_ids(out.keys_to_store) == [5, 6]


def test_every_other_call_is_delegated_unchanged() -> None:
    m = make(tracker=100)
    m.prepare_store(keys(1))
    m.prepare_store(keys(1))
    assert m.lookup(key(1)) is None
    m.complete_store(keys(1))
    assert m.prepare_load(keys(1)).block_ids.tolist() == [0]
    m.complete_load(keys(1))
    assert [ev.removed for ev in m.take_events()] == [False]
    assert m.stats().idle == 1  # backing manager's attributes stay reachable


@pytest.mark.parametrize(("threshold", "tracker"), [(1, 10), (0, 10), (2, 0)])
def test_invalid_filter_settings_are_rejected(threshold: int, tracker: int) -> None:
    with pytest.raises(ConfigError):
        FilterReusedOffloadingManager(CPUOffloadingManager(1), threshold, tracker)
