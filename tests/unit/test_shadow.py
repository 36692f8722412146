"""Shadow policies: what each candidate would have hit, next to the live policy, while serving."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcache_offload.aio import OffloadEngine
from kvcache_offload.errors import ConfigError, UnknownPolicyError
from kvcache_offload.lab.driver import replay_trace
from kvcache_offload.lab.shadow import ShadowPolicies
from kvcache_offload.lab.sweep import make_manager
from kvcache_offload.lab.trace import (
    load_trace,
    sample_trace_path,
)
from kvcache_offload_service import create_app
from kvcache_offload_service.observers import build_observers
from tests.unit._api_app import hex_key, small_config, store

POLICIES = ["arc", "alru", "s3fifo-prefix"]


@pytest.fixture(scope="module")
def trace():  # type: ignore[no-untyped-def]
    return load_trace(sample_trace_path())


def _feed(shadow: ShadowPolicies, trace) -> None:  # type: ignore[no-untyped-def]
    for keys in trace.keys:
        shadow.on_lookup(keys, 0)
        shadow.on_store(keys)


@pytest.mark.parametrize("capacity_pct", [2, 10])
def test_unsampled_shadows_hit_exactly_like_full_replays(trace, capacity_pct: int) -> None:  # type: ignore[no-untyped-def]
    capacity = round(trace.num_unique_blocks * capacity_pct / 100)
    shadow = ShadowPolicies(POLICIES, live="lru", sample_blocks=capacity)
    shadow.bind_capacity(capacity)
    assert shadow.sample_rate == 1.0
    _feed(shadow, trace)
    stats = shadow.shadow_stats()
    assert stats.live == "lru"
    assert stats.sampled_blocks == trace.num_block_accesses
    for policy in ["lru", *POLICIES]:
        full = replay_trace(make_manager(policy, capacity), trace)
        assert stats.hit_blocks[policy] == full.block_hits, policy
        assert stats.hit_ratio()[policy] == pytest.approx(full.block_hit_rate)


def test_sampled_shadows_see_a_proportional_share_of_the_keys(trace) -> None:  # type: ignore[no-untyped-def]
    capacity = round(trace.num_unique_blocks * 0.2)
    shadow = ShadowPolicies(["arc"], live="lru", sample_blocks=capacity // 4)
    shadow.bind_capacity(capacity)
    assert shadow.sample_rate == pytest.approx(0.25, rel=0.01)
    _feed(shadow, trace)
    stats = shadow.shadow_stats()
    assert 0.15 < stats.sampled_blocks / trace.num_block_accesses < 0.35
    for ratio in stats.hit_ratio().values():
        assert 0.0 <= ratio <= 1.0


def test_the_reuse_filter_runs_in_front_of_every_shadow(trace) -> None:  # type: ignore[no-untyped-def]
    capacity = round(trace.num_unique_blocks * 0.05)
    shadow = ShadowPolicies([], live="lru", store_threshold=2, sample_blocks=capacity)
    shadow.bind_capacity(capacity)
    _feed(shadow, trace)
    full = replay_trace(make_manager("lru", capacity, 2), trace)
    assert shadow.shadow_stats().hit_blocks["lru"] == full.block_hits


def test_nothing_is_simulated_before_the_capacity_is_known() -> None:
    shadow = ShadowPolicies(["arc"], live="lru")
    shadow.on_lookup([bytes(12)], 0)
    assert shadow.shadow_stats().sampled_blocks == 0
    shadow.bind_capacity(0)
    shadow.on_lookup([bytes(12)], 0)
    assert shadow.shadow_stats().hit_blocks == {}


def test_reset_starts_the_counts_over(trace) -> None:  # type: ignore[no-untyped-def]
    shadow = ShadowPolicies(["arc"], live="lru", sample_blocks=64)
    shadow.bind_capacity(64)
    _feed(shadow, trace)
    assert shadow.shadow_stats().sampled_blocks > 0
    shadow.reset()
    assert shadow.shadow_stats().sampled_blocks == 0
    assert set(shadow.shadow_stats().hit_blocks) == {"lru", "arc"}


def test_bad_parameters_fail_at_construction() -> None:
    with pytest.raises(UnknownPolicyError):
        ShadowPolicies(["no-such-policy"], live="lru")
    with pytest.raises(ConfigError):
        ShadowPolicies(["arc"], live="lru", sample_blocks=0)
    with pytest.raises(ConfigError):
        small_config(shadow_sample_blocks=0)


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_the_service_exports_each_candidates_hit_ratio_next_to_the_live_one() -> None:
    config = small_config(shadow_policies=["arc", "s3fifo"], eviction_policy="lru")
    observers = build_observers(config)
    async with OffloadEngine(config, access_observers=observers) as engine:
        app = create_app(engine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            keys = [hex_key(i) for i in range(4)]
            for _ in range(3):
                await client.post("/v1/lookup", json={"keys": keys})
                await store(client, keys)
            text = (await client.get("/metrics")).text
    samples = _samples(text)
    # Every key of the small tier is sampled: 3 lookups of 4 keys, the last two all hits.
    assert samples[("kvcache_offload_shadow_lookup_blocks_total", frozenset())] == 12
    for policy, live in [("lru", "true"), ("arc", "false"), ("s3fifo", "false")]:
        labels = frozenset({"policy": policy, "live": live}.items())
        assert samples[("kvcache_offload_shadow_hit_blocks_total", labels)] == 8
        assert samples[("kvcache_offload_shadow_hit_ratio", labels)] == pytest.approx(8 / 12)


def test_an_empty_candidate_list_turns_the_shadows_off() -> None:
    observers = build_observers(small_config(shadow_policies=[]))
    assert not any(isinstance(o, ShadowPolicies) for o in observers)
