"""The adaptive policy serves with the candidate its miniatures favour; LRU-2 keeps reuse."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvcache_offload import CPUOffloadingManager
from kvcache_offload._compiled import PURE_PYTHON_ENV
from kvcache_offload.control.policies import (
    AdaptiveCachePolicy,
    BlockStatus,
    CachePolicy,
    LRU2CachePolicy,
)
from kvcache_offload.lab.driver import replay_trace
from kvcache_offload.lab.trace import (
    Trace,
    TraceRequest,
    load_trace,
    sample_trace_path,
    trace_from_requests,
)
from tests.unit._keys import key, key_ids


def _trace(requests: list[list[int]]) -> Trace:
    return trace_from_requests(
        TraceRequest(float(i), 512 * len(ids), 1, [key(k) for k in ids])
        for i, ids in enumerate(requests)
    )


def _hot_set_under_one_offs(rounds: int = 30) -> Trace:
    """150 hot blocks, each followed by four blocks never seen again: LRU's reuse distance
    (750 blocks) is far beyond a 256-block cache, but the hot set fits."""
    return _trace(_hot_set_requests(rounds))


def _hot_set_requests(rounds: int) -> list[list[int]]:
    requests: list[list[int]] = []
    fresh = 10_000
    for _ in range(rounds):
        for i in range(150):
            requests.append([(i * 37) % 150])
            for _ in range(4):
                requests.append([fresh])
                fresh += 1
    return requests


def _reused_once_soon(steps: int = 6000) -> Trace:
    """A set used three times, then a stream where each block comes back once, 120 requests
    later and never again: recency is all there is, and LRU-2 holds on to the stale set."""
    return _trace(_reused_once_soon_requests(steps))


def _reused_once_soon_requests(steps: int, base: int = 0) -> list[list[int]]:
    requests = [[base + i] for _ in range(3) for i in range(200)]
    for t in range(steps):
        requests.append([base + 1000 + t])
        if t >= 120:
            requests.append([base + 1000 + t - 120])
    return requests


def _hit_rate(policy: str | type[CachePolicy], trace: Trace, capacity: int = 256) -> float:
    return replay_trace(CPUOffloadingManager(capacity, policy), trace).block_hit_rate


class _LruOrLru2(AdaptiveCachePolicy):
    candidates = ("lru", "lru2")


class _Lru2OrLru(AdaptiveCachePolicy):
    candidates = ("lru2", "lru")


def test_adaptive_switches_to_lru2_when_one_off_blocks_flush_a_hot_set() -> None:
    trace = _hot_set_under_one_offs()
    lru, lru2 = _hit_rate("lru", trace), _hit_rate("lru2", trace)
    assert lru2 > lru + 0.1  # the workload separates them clearly
    manager = CPUOffloadingManager(256, _LruOrLru2)
    adaptive = replay_trace(manager, trace).block_hit_rate
    assert manager.policy.debug_state()["live"] == "lru2"
    assert adaptive > lru + 0.8 * (lru2 - lru)


def test_adaptive_switches_back_to_lru_when_recency_wins() -> None:
    trace = _reused_once_soon()
    lru, lru2 = _hit_rate("lru", trace), _hit_rate("lru2", trace)
    assert lru > lru2 + 0.1
    manager = CPUOffloadingManager(256, _Lru2OrLru)
    adaptive = replay_trace(manager, trace).block_hit_rate
    assert manager.policy.debug_state()["live"] == "lru"
    assert adaptive > lru2 + 0.8 * (lru - lru2)


def test_adaptive_default_never_falls_below_lru_on_scans_or_loops() -> None:
    for trace in (_hot_set_under_one_offs(10), _reused_once_soon(3000)):
        assert _hit_rate("adaptive", trace) >= _hit_rate("lru", trace) - 0.01


def test_adaptive_ignores_noise_between_equal_candidates() -> None:
    # Two copies of one policy always tie: the race must never switch between them.
    class _Twins(AdaptiveCachePolicy):
        candidates = ("lru", "lru")

    manager = CPUOffloadingManager(64, _Twins)
    replay_trace(manager, _hot_set_under_one_offs(5))
    assert manager.policy.debug_state()["switches"] == 0


class _NeverRests(_LruOrLru2):
    rest_windows = 0.0


def test_the_race_rests_while_the_live_candidate_leads_widely() -> None:
    trace = _hot_set_under_one_offs(60)
    resting, racing = CPUOffloadingManager(256, _LruOrLru2), CPUOffloadingManager(256, _NeverRests)
    a, b = replay_trace(resting, trace), replay_trace(racing, trace)
    state = resting.policy.debug_state()
    assert state["live"] == "lru2" and state["race_rests"] >= 2  # it raced again after a rest
    assert racing.policy.debug_state()["race_rests"] == 0
    assert a.block_hits == b.block_hits  # the same decisions, for a fraction of the race
    assert resting.policy._race.sampled_blocks < racing.policy._race.sampled_blocks / 3  # type: ignore[attr-defined]


def test_a_rest_does_not_stop_a_later_switch() -> None:
    # LRU-2 wins widely (the race rests), then the traffic turns to recency: after a rest
    # the race sees it and the live cache goes back to LRU.
    requests = _hot_set_requests(30) + _reused_once_soon_requests(6000, base=100_000)
    manager = CPUOffloadingManager(256, _LruOrLru2)
    replay_trace(manager, _trace(requests))
    state = manager.policy.debug_state()
    assert state["race_rests"] >= 1
    assert state["live"] == "lru" and state["switches"] == 2


def test_a_live_lru2_shares_the_block_table_across_switches() -> None:
    # The manager looks blocks up in the policy's table: it must stay the same dict, holding
    # exactly the stored blocks, whichever candidate serves.
    policy = AdaptiveCachePolicy(8)
    table = policy.block_table()
    blocks = {i: BlockStatus(i) for i in range(8)}
    for i, block in blocks.items():
        policy.insert(key(i), block)
        block.ref_cnt = 0
    for name in ("lru2", "alru", "lru2"):
        policy._switch(name)  # type: ignore[attr-defined]
        assert policy.live_policy == name and policy.block_table() is table
        assert table == {key(i): blocks[i] for i in blocks}
    victims = policy.evict(3, frozenset())
    assert victims is not None and len(victims) == 3
    for i in key_ids(k for k, _ in victims):
        del blocks[i]
    assert table == {key(i): blocks[i] for i in blocks} and len(policy) == 5
    policy.insert(key(100), BlockStatus(100))
    policy.remove(key(100))
    assert len(table) == 5 and policy.get(key(100)) is None


def test_a_switch_keeps_every_block_and_its_state() -> None:
    policy = _LruOrLru2(8)
    blocks = {i: BlockStatus(i) for i in range(8)}
    for i, block in blocks.items():
        policy.insert(key(i), block)
        block.ref_cnt = 0
    blocks[3].ref_cnt = 2  # being read
    policy.touch([key(5), key(6)])
    policy._switch("lru2")  # type: ignore[attr-defined]
    assert policy.live_policy == "lru2"
    assert len(policy) == 8 and all(policy.get(key(i)) is blocks[i] for i in range(8))
    assert blocks[3].ref_cnt == 2
    victims = policy.evict(7, frozenset())
    assert victims is not None
    # The old order (LRU: 0, 1, 2, 4, 7, 6, 5 idle, least recent first; touch leaves its
    # first key most recent) is kept; 3 is being read.
    assert key_ids(k for k, _ in victims) == [0, 1, 2, 4, 7, 6, 5]


def test_lru2_evicts_blocks_used_once_before_reused_ones_by_second_last_use() -> None:
    policy = LRU2CachePolicy(10)
    blocks = {i: BlockStatus(i) for i in range(6)}
    for i, block in blocks.items():
        policy.insert(key(i), block)
        block.ref_cnt = 0
    policy.touch([key(0)])
    policy.touch([key(1)])
    policy.touch([key(0)])  # 0: second-last use now after 1's
    victims = policy.evict(6, frozenset())
    assert victims is not None
    # Stores are prefix batches (tail first), so the once-used 5..2 leave tail first.
    assert key_ids(k for k, _ in victims) == [5, 4, 3, 2, 1, 0]


_PROBE = """
import json, sys
from kvcache_offload import CPUOffloadingManager
from kvcache_offload.lab.driver import replay_trace
from kvcache_offload.lab.trace import load_trace, sample_trace_path
trace = load_trace(sample_trace_path())
out = []
for capacity in (40, 400):
    manager = CPUOffloadingManager(capacity, "adaptive")
    counts = replay_trace(manager, trace)
    state = manager.policy.debug_state()
    out.append([counts.block_hits, counts.evictions, state["live"], state["switches"]])
print(json.dumps(out))
"""


def test_adaptive_decides_the_same_compiled_and_pure() -> None:
    here = json.loads(subprocess.check_output([sys.executable, "-c", _PROBE], text=True))
    env = {**os.environ, PURE_PYTHON_ENV: "1"}
    pure = json.loads(subprocess.check_output([sys.executable, "-c", _PROBE], text=True, env=env))
    assert here == pure
    trace = load_trace(sample_trace_path())
    assert here[0][0] > 0 and trace.num_requests > 0


def test_adaptive_decides_exactly_as_alru_until_it_switches() -> None:
    # The race's alru follows the live alru's weight instead of running miniatures of its
    # own, and nothing of the race reaches the live cache before a switch.
    trace = load_trace(sample_trace_path())
    for capacity in (40, 400):
        adaptive = CPUOffloadingManager(capacity, "adaptive")
        alone = CPUOffloadingManager(capacity, "alru")
        a, b = replay_trace(adaptive, trace), replay_trace(alone, trace)
        assert adaptive.policy.debug_state()["switches"] == 0
        assert (a.block_hits, a.evictions) == (b.block_hits, b.evictions)
