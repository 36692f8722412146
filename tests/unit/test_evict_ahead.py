"""Choosing victims ahead: once a lone store's copy is on its way, an LRU policy chooses
what the next store of its size would evict, so that store's copy starts without the choice
in front of it.

What users rely on: the next store evicts the keys and reuses the slots it would have
anyway; the chosen blocks stay loadable until then (a lookup finds them, a load, touch or
store puts them back where they were), so hit rates and eviction events do not change;
nothing being read or written is chosen; at most ``evict_ahead_fraction`` of the tier is
chosen, and 0 turns it off. A policy whose choice ahead would differ from its choice at need
(every shipped one but LRU) chooses nothing, and replaying a trace with choices ahead after
every store decides exactly as at need, whatever the policy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvcache_offload.aio import EventType, OffloadEngine
from kvcache_offload.contracts.load_store_spec import BlockIDsLoadStoreSpec
from kvcache_offload.control.manager import CPUOffloadingManager
from kvcache_offload.control.policies.registry import (
    available_cache_policies,
    get_cache_policy_cls,
)
from kvcache_offload.lab.driver import replay_trace
from kvcache_offload.lab.trace import load_trace, sample_trace_path
from tests.unit._aio_fakes import NO_KV, FakeHandler, FakeSpec, small_config, wait_for
from tests.unit._keys import key, key_ids, keys

CHOOSING = [p for p in available_cache_policies() if get_cache_policy_cls(p).chooses_ahead]
NOT_CHOOSING = [p for p in available_cache_policies() if p not in CHOOSING]


def filled(policy: str, n: int = 16) -> CPUOffloadingManager:
    """A full tier of keys 0..n-1, some of them used again (so the policies disagree)."""
    manager = CPUOffloadingManager(n, policy, enable_events=True)
    for start in range(0, n, 4):
        ks = keys(*range(start, start + 4))
        out = manager.prepare_store(ks)
        assert out is not None
        manager.complete_store(out.keys_to_store)
    manager.touch(keys(3, 1, 7))
    manager.touch(keys(12))
    list(manager.take_events())
    return manager


def slot_ids(spec: object) -> list[int]:
    assert isinstance(spec, BlockIDsLoadStoreSpec)
    return [int(b) for b in spec.block_ids]


def test_lru_chooses_ahead_and_the_policies_that_would_decide_otherwise_do_not() -> None:
    assert CHOOSING == ["lru"]
    assert {"adaptive", "arc", "lru2", "alru"} <= set(NOT_CHOOSING)


@pytest.mark.parametrize("policy", NOT_CHOOSING)
def test_a_policy_whose_choice_ahead_would_differ_chooses_nothing(policy: str) -> None:
    at_need, manager = filled(policy), filled(policy)
    assert manager.chooses_ahead is False
    assert manager.evict_ahead(3) == 0
    assert manager.stats() == at_need.stats()
    out = manager.prepare_store(keys(100, 101, 102))
    expected = at_need.prepare_store(keys(100, 101, 102))
    assert out is not None and expected is not None
    assert out.evicted_keys == expected.evicted_keys


@pytest.mark.parametrize("policy", available_cache_policies())
@pytest.mark.parametrize("share", [0.02, 0.10])
def test_choosing_ahead_after_every_store_decides_as_at_need_on_a_trace(
    policy: str, share: float
) -> None:
    # The most choosing ahead can do (the engine does it after lone stores only), through
    # the lab's driver: lookups, loads, touches and stores of a real prefix-cache trace.
    # A policy that chose ahead without saying it may would lose hits this way (ARC up to
    # 5 %, the default policy up to 1.9 %: the last store's blocks, still being written,
    # cannot be chosen, so older and better blocks would go instead).
    class ChoosingAhead(CPUOffloadingManager):
        def prepare_store(self, keys: Any, req_context: Any = None) -> Any:
            out = super().prepare_store(keys, req_context)
            if out is not None and out.keys_to_store:
                self.evict_ahead(max(1, len(out.keys_to_store)))
            return out

    trace = load_trace(sample_trace_path())
    blocks = max(8, int(trace.num_unique_blocks * share))
    at_need = replay_trace(CPUOffloadingManager(blocks, policy), trace)
    ahead_manager = ChoosingAhead(blocks, policy)
    ahead = replay_trace(ahead_manager, trace)
    assert (ahead.block_hits, ahead.evictions) == (at_need.block_hits, at_need.evictions)
    if policy in CHOOSING:  # it did choose, and some chosen blocks came back
        stats = ahead_manager.stats()
        assert stats.ahead_evictions > 0 and stats.ahead_rescued > 0


@pytest.mark.parametrize("policy", CHOOSING)
def test_the_next_store_evicts_the_keys_and_reuses_the_slots_it_would_have(policy: str) -> None:
    at_need, ahead = filled(policy), filled(policy)
    new = keys(100, 101, 102)

    out_at_need = at_need.prepare_store(new)
    assert ahead.evict_ahead(3) == 3
    out_ahead = ahead.prepare_store(new)

    assert out_at_need is not None and out_ahead is not None
    assert out_ahead.evicted_keys == out_at_need.evicted_keys
    assert len(out_ahead.evicted_keys) == 3
    assert slot_ids(out_ahead.store_spec) == slot_ids(out_at_need.store_spec)
    assert [(e.removed, e.keys) for e in ahead.take_events()] == [
        (e.removed, e.keys) for e in at_need.take_events()
    ]
    assert ahead.stats().evictions == at_need.stats().evictions == 3
    assert (ahead.stats().ahead_evictions, ahead.stats().chosen_ahead) == (3, 0)


def test_chosen_blocks_stay_loadable_and_nothing_is_published_until_a_store_takes_them() -> None:
    manager = filled("lru")
    assert manager.evict_ahead(2) == 2
    assert list(manager.take_events()) == []
    stats = manager.stats()
    assert (stats.free, stats.idle, stats.evictions, stats.chosen_ahead) == (0, 16, 0, 2)
    assert manager.lookup(key(0)) is True and manager.lookup(key(2)) is True
    # Already chosen: asking again chooses no more.
    assert manager.evict_ahead(2) == 0
    assert manager.evict_ahead(1) == 0
    out = manager.prepare_store(keys(100))
    assert out is not None and key_ids(out.evicted_keys) == [0]
    assert [(e.removed, key_ids(e.keys)) for e in manager.take_events()] == [(True, [0])]
    assert manager.lookup(key(0)) is False
    assert manager.lookup(key(2)) is True  # still chosen, still loadable


@pytest.mark.parametrize("use", ["load", "touch", "store", "store, no touch"])
def test_a_chosen_block_used_again_is_kept_and_lru_decides_as_at_need(use: str) -> None:
    at_need, ahead = filled("lru"), filled("lru")
    assert ahead.evict_ahead(2) == 2  # keys 0 and 2 (LRU)
    for manager in (at_need, ahead):
        if use == "load":
            spec = manager.prepare_load(keys(0))
            manager.complete_load(keys(0))
            manager.touch(keys(0))
        elif use == "touch":
            manager.touch(keys(0))
        else:  # a store naming a present key skips it (vLLM then touches all its keys)
            out = manager.prepare_store(keys(0))
            assert out is not None and out.keys_to_store == []
            if use == "store":
                manager.touch(keys(0))
    if use == "load":
        assert slot_ids(spec) == [0]
    assert ahead.stats().ahead_rescued == 1
    out_at_need = at_need.prepare_store(keys(100, 101))
    out_ahead = ahead.prepare_store(keys(100, 101))
    assert out_at_need is not None and out_ahead is not None
    # Untouched, key 0 is back where it was, the least recent: the next to go, as at need
    # (after the block still chosen).
    expected = [0, 2] if use == "store, no touch" else [2, 4]
    assert sorted(key_ids(out_ahead.evicted_keys)) == key_ids(out_at_need.evicted_keys) == expected
    assert ahead.lookup(key(0)) is (use != "store, no touch")


def test_blocks_put_back_keep_the_order_they_were_chosen_in() -> None:
    at_need, ahead = filled("lru"), filled("lru")
    assert ahead.evict_ahead(3) == 3  # keys 0, 2 and 4, least recent first
    for manager in (at_need, ahead):
        # A load names them in another order; it does not touch them (the caller may not).
        manager.prepare_load(keys(4, 0, 2))
        manager.complete_load(keys(4, 0, 2))
    assert ahead.stats().ahead_rescued == 3
    for manager in (at_need, ahead):
        out = manager.prepare_store(keys(100, 101, 102, 103))
        assert out is not None and key_ids(out.evicted_keys) == [0, 2, 4, 5]


def test_choosing_ahead_never_takes_blocks_being_read_or_written() -> None:
    manager = CPUOffloadingManager(4, "lru", enable_events=True)
    out = manager.prepare_store(keys(0, 1, 2, 3))
    assert out is not None
    assert manager.evict_ahead(2) == 0  # all four being written
    manager.complete_store(keys(0, 1))
    manager.prepare_load(keys(0))
    assert manager.evict_ahead(2) == 1  # one idle block (1): only it, though two were asked
    assert manager.stats().chosen_ahead == 1
    manager.complete_load(keys(0))
    assert manager.evict_ahead(2) == 1
    out = manager.prepare_store(keys(10, 11))
    assert out is not None and key_ids(out.evicted_keys) == [1, 0]


def test_nothing_is_chosen_while_released_keys_wait_and_they_go_first_at_need() -> None:
    manager, at_need = filled("lru"), filled("lru")
    assert manager.release(keys(9, 11)) == at_need.release(keys(9, 11)) == 2
    assert manager.evict_ahead(3) == 0
    out = manager.prepare_store(keys(100, 101, 102))
    expected = at_need.prepare_store(keys(100, 101, 102))
    assert out is not None and expected is not None
    assert sorted(key_ids(out.evicted_keys)) == sorted(key_ids(expected.evicted_keys)) == [0, 9, 11]
    assert manager.stats().released_evictions == 2


def test_keys_released_after_a_choice_ahead_still_go_first_as_at_need() -> None:
    manager, at_need = filled("lru"), filled("lru")
    assert manager.evict_ahead(2) == 2  # keys 0 and 2
    assert manager.release(keys(9, 11)) == at_need.release(keys(9, 11)) == 2
    assert manager.stats().chosen_ahead == 0  # put back where LRU had them
    for step in range(2):  # the released keys, then LRU's own choice
        out = manager.prepare_store(keys(100 + step * 2, 101 + step * 2))
        expected = at_need.prepare_store(keys(100 + step * 2, 101 + step * 2))
        assert out is not None and expected is not None
        assert key_ids(out.evicted_keys) == key_ids(expected.evicted_keys)
    assert key_ids(expected.evicted_keys) == [0, 2]


def test_a_release_that_marks_nothing_leaves_the_choice_ahead() -> None:
    manager = filled("lru")
    assert manager.evict_ahead(2) == 2  # keys 0 and 2
    assert manager.release(keys(99)) == 0  # absent: nothing to leave first
    stats = manager.stats()
    assert (stats.chosen_ahead, stats.ahead_rescued, stats.released) == (2, 0, 0)
    out = manager.prepare_store(keys(100, 101))
    assert out is not None and key_ids(out.evicted_keys) == [0, 2]


def test_a_chosen_key_released_is_put_back_and_leaves_as_at_need() -> None:
    manager, at_need = filled("lru"), filled("lru")
    assert manager.evict_ahead(2) == 2  # keys 0 and 2
    assert manager.release(keys(2)) == at_need.release(keys(2)) == 1
    stats = manager.stats()
    assert (stats.chosen_ahead, stats.ahead_rescued, stats.released) == (0, 2, 1)
    out = manager.prepare_store(keys(100, 101))
    expected = at_need.prepare_store(keys(100, 101))
    assert out is not None and expected is not None
    assert key_ids(out.evicted_keys) == key_ids(expected.evicted_keys)
    assert sorted(key_ids(out.evicted_keys)) == [0, 2]


def test_discard_fence_and_reset_handle_chosen_blocks() -> None:
    manager = filled("lru")
    assert manager.evict_ahead(3) == 3  # keys 0, 2, 4
    assert key_ids(manager.discard(keys(2))) == [2]
    assert manager.stats().free == 1
    assert manager.lookup(key(2)) is False
    fenced = manager.fence(keys(4))
    assert len(fenced) == 1 and manager.stats().fenced == 1
    assert manager.lookup(key(4)) is False
    assert manager.stats().chosen_ahead == 1
    manager.reset_cache()
    stats = manager.stats()
    assert (stats.chosen_ahead, stats.idle) == (0, 0)
    assert manager.lookup(key(0)) is False


def make_engine(
    num_blocks: int, handler: FakeHandler | None = None, **config: Any
) -> OffloadEngine:
    config.setdefault("eviction_policy", "lru")
    cfg = small_config(num_blocks, **config)
    return OffloadEngine(cfg, spec=FakeSpec(cfg, handler), kv_caches=NO_KV)


async def test_the_default_policy_chooses_its_victims_at_need_behind_a_lone_store() -> None:
    handler = FakeHandler()
    cfg = small_config(64)  # the default policy (adaptive)
    async with OffloadEngine(cfg, spec=FakeSpec(cfg, handler), kv_caches=NO_KV) as engine:
        assert engine.manager.chooses_ahead is False  # type: ignore[attr-defined]
        await engine.store(keys(*range(64)), list(range(64)))
        handler.auto = False
        lone = asyncio.create_task(engine.store(keys(100, 101), [0, 1]))
        await wait_for(lambda: len(handler.pending) == 1)
        assert engine.manager.stats().chosen_ahead == 0  # type: ignore[attr-defined]
        handler.auto = True
        await lone
        await engine.store(keys(102, 103), [2, 3])
        stats = engine.stats()
        assert (stats.evicted_blocks, stats.evicted_ahead_blocks) == (4, 0)


async def test_a_lone_engine_store_chooses_the_next_stores_victims() -> None:
    async with make_engine(64) as engine:  # 1/32 of 64 blocks: at most 2 chosen ahead
        await engine.store(keys(*range(64)), list(range(64)))
        first = await engine.store(keys(100, 101), [0, 1])
        assert key_ids(first.evicted_keys) == [0, 1]
        # 2 and 3 are chosen for the next store, and still there.
        assert engine.manager.stats().chosen_ahead == 2  # type: ignore[attr-defined]
        assert (await engine.lookup(keys(2, 3))).hits == 2

        second = await engine.store(keys(102, 103), [2, 3])
        assert key_ids(second.evicted_keys) == [2, 3]
        stats = engine.stats()
        assert (stats.evicted_blocks, stats.evicted_ahead_blocks) == (4, 2)
        evicted_events = [
            key_ids(e.keys) for e in engine.event_hub.recent(0) if e.type is EventType.EVICTED
        ]
        assert evicted_events == [[0, 1], [2, 3]]
        assert (await engine.lookup(keys(100, 101, 102, 103))).hits == 4


async def test_at_most_the_fraction_of_the_tier_is_chosen() -> None:
    async with make_engine(64) as engine:
        await engine.store(keys(*range(64)), list(range(64)))
        await engine.store(keys(*range(100, 108)), list(range(8)))
        assert engine.manager.stats().chosen_ahead == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("num_blocks", "fraction"), [(64, 0.0), (16, 1 / 32)], ids=["off", "small-tier"]
)
async def test_nothing_is_chosen_when_off_or_in_a_tier_too_small(
    num_blocks: int, fraction: float
) -> None:
    async with make_engine(num_blocks, transfer={"evict_ahead_fraction": fraction}) as engine:
        await engine.store(keys(*range(num_blocks)), list(range(num_blocks)))
        await engine.store(keys(100, 101), [0, 1])
        assert engine.manager.stats().chosen_ahead == 0  # type: ignore[attr-defined]
        assert engine.stats().evicted_ahead_blocks == 0


async def test_stores_behind_other_jobs_in_flight_choose_at_need() -> None:
    # In a stream the loop thread is the bottleneck and no lone copy hides the work: only a
    # store whose copy is in flight alone chooses ahead.
    handler = FakeHandler()
    async with make_engine(64, handler) as engine:
        await engine.store(keys(*range(64)), list(range(64)))
        handler.auto = False  # copies now end when the test says
        lone = asyncio.create_task(engine.store(keys(100, 101), [0, 1]))
        await wait_for(lambda: len(handler.pending) == 1)
        assert engine.manager.stats().chosen_ahead == 2  # type: ignore[attr-defined]
        behind = asyncio.create_task(engine.store(keys(102, 103), [2, 3]))
        await wait_for(lambda: len(handler.pending) == 2)
        third = asyncio.create_task(engine.store(keys(104, 105), [4, 5]))
        await wait_for(lambda: len(handler.pending) == 3)
        assert engine.manager.stats().chosen_ahead == 0  # type: ignore[attr-defined]
        handler.release()
        results = await asyncio.gather(lone, behind, third)
        assert [key_ids(r.evicted_keys) for r in results] == [[0, 1], [2, 3], [4, 5]]
        assert engine.stats().evicted_ahead_blocks == 2


def test_a_refused_store_leaves_the_chosen_blocks_chosen() -> None:
    manager = CPUOffloadingManager(4, "lru", enable_events=True)
    out = manager.prepare_store(keys(0, 1, 2, 3))
    assert out is not None
    manager.complete_store(out.keys_to_store)
    assert manager.evict_ahead(1) == 1  # key 0
    # Three new keys need three slots: key 0, then two of the policy's, but keys 1 and 2
    # are this store's own and survive it, which leaves only key 3.
    assert manager.prepare_store(keys(1, 2, 10, 11, 12)) is None
    stats = manager.stats()
    assert (stats.chosen_ahead, stats.evictions, stats.rejected_stores) == (1, 0, 1)
    assert manager.lookup(key(0)) is True and manager.lookup(key(3)) is True
    out = manager.prepare_store(keys(10))
    assert out is not None and key_ids(out.evicted_keys) == [0]
