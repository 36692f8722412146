"""The live miss-ratio curve: agrees with an exact LRU simulation, stays within its memory."""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_offload import OffloadKey
from kvcache_offload.errors import ConfigError
from kvcache_offload.lab.mrc import (
    DEFAULT_SCALES,
    MissRatioCurve,
)
from tests.unit._keys import key


def _stable_hash(k: OffloadKey) -> int:
    """Deterministic, well-mixed 32-bit hash so the sample does not depend on the salt."""
    h = zlib.crc32(k)
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    return ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF


def _prefix_trace(seed: int, requests: int) -> list[list[OffloadKey]]:
    """Multi-turn conversations behind a shared system prompt, Zipf-like popularity.

    Each turn repeats the conversation so far and appends a few blocks, like the Mooncake
    conversation trace.
    """
    rng = random.Random(seed)
    conversations: list[list[int]] = []
    next_id = 1
    trace = []
    for _ in range(requests):
        if not conversations or rng.random() < 0.5:
            conversations.append([0])
        index = min(int(rng.paretovariate(0.5)) - 1, len(conversations) - 1)
        conv = conversations[-1 - index]
        grow = rng.randint(1, 4)
        conv.extend(range(next_id, next_id + grow))
        next_id += grow
        trace.append([key(i) for i in conv])
    return trace


def _exact_lru_hit_ratio(trace: Sequence[Sequence[OffloadKey]], capacity: int) -> float:
    """Per-block LRU hits with keys applied tail first (the manager's touch order)."""
    cache: OrderedDict[OffloadKey, None] = OrderedDict()
    hits = total = 0
    for keys in trace:
        for k in reversed(keys):
            total += 1
            if k in cache:
                hits += 1
                cache.move_to_end(k)
            else:
                cache[k] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / total


def test_unsampled_curve_matches_exact_lru() -> None:
    trace = _prefix_trace(seed=1, requests=600)
    mrc = MissRatioCurve(sample_rate=1.0, max_keys=100_000, hash_fn=_stable_hash)
    for keys in trace:
        mrc.on_lookup(keys, 0)
    assert mrc.sample_rate == 1.0
    for capacity in (50, 200, 800, 3000):
        exact = _exact_lru_hit_ratio(trace, capacity)
        # Only the histogram's ~3% distance bins separate the two.
        assert mrc.hit_ratio(capacity) == pytest.approx(exact, abs=0.01)


@pytest.mark.parametrize("seed", [2, 3])
def test_sampled_curve_is_close_to_exact_lru(seed: int) -> None:
    trace = _prefix_trace(seed=seed, requests=3000)
    mrc = MissRatioCurve(sample_rate=1.0, max_keys=1024, hash_fn=_stable_hash)
    for keys in trace:
        mrc.on_lookup(keys, 0)
    unique = len({k for keys in trace for k in keys})
    assert mrc.sample_rate < 1024 / unique * 1.5, "the rate fell to fit the key budget"
    capacity = unique // 20
    curve, sampled = mrc.mrc_stats(capacity)
    assert sampled <= 1024
    for scale, estimate in curve.items():
        exact = _exact_lru_hit_ratio(trace, int(scale * capacity))
        assert estimate == pytest.approx(exact, abs=0.05), f"scale {scale}"


def test_memory_stays_bounded_on_an_endless_stream_of_new_keys() -> None:
    mrc = MissRatioCurve(sample_rate=1.0, max_keys=128, hash_fn=_stable_hash)
    for start in range(0, 60_000, 20):
        mrc.on_lookup([key(0), *(key(i) for i in range(start + 1, start + 20))], 1)
    state = mrc.debug_state()
    assert state["tracked_keys"] == 128
    assert state["heap"] == 128
    assert state["tree_size"] == 2 * 128 + 64
    assert int(state["bins"]) < 2000  # type: ignore[call-overload]
    assert mrc.sample_rate < 0.01
    assert mrc.mrc_stats(100)[1] == 128


def test_curve_has_every_scale_is_bounded_and_grows_with_capacity() -> None:
    mrc = MissRatioCurve(hash_fn=_stable_hash)
    for keys in _prefix_trace(seed=4, requests=300):
        mrc.on_lookup(keys, 0)
    curve, sampled = mrc.mrc_stats(100)
    assert tuple(curve) == DEFAULT_SCALES
    values = list(curve.values())
    assert all(0.0 <= v <= 1.0 for v in values)
    assert values == sorted(values)
    assert sampled > 0


def test_stores_and_empty_lookups_are_not_accesses() -> None:
    mrc = MissRatioCurve(hash_fn=_stable_hash)
    mrc.on_lookup([], 0)
    mrc.on_store([key(1), key(2)])
    assert mrc.accesses == 0
    assert mrc.mrc_stats(10) == ({s: 0.0 for s in DEFAULT_SCALES}, 0)


def test_reset_forgets_everything() -> None:
    mrc = MissRatioCurve(sample_rate=1.0, max_keys=4, hash_fn=_stable_hash)
    for i in range(20):
        mrc.on_lookup([key(i), key(i)], 0)
    mrc.reset()
    assert mrc.accesses == 0
    assert mrc.sample_rate == 1.0
    assert mrc.mrc_stats(10)[1] == 0


@pytest.mark.parametrize(("rate", "max_keys"), [(0.0, 10), (1.5, 10), (0.5, 0)])
def test_bad_parameters_are_config_errors(rate: float, max_keys: int) -> None:
    with pytest.raises(ConfigError):
        MissRatioCurve(sample_rate=rate, max_keys=max_keys)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6), max_size=80),
    st.integers(1, 50),
)
def test_curve_is_bounded_and_monotone_for_any_access_stream(
    lookups: list[list[int]], capacity: int
) -> None:
    mrc = MissRatioCurve(sample_rate=1.0, max_keys=8, hash_fn=_stable_hash)
    for ids in lookups:
        mrc.on_lookup([key(i) for i in ids], 0)
    curve, sampled = mrc.mrc_stats(capacity)
    assert sampled <= 8
    values = list(curve.values())
    assert all(0.0 <= v <= 1.0 for v in values)
    assert values == sorted(values)
