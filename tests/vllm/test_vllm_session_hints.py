"""A request that says its session ends (``kv_transfer_params``) has its blocks evicted first,
through vLLM's own Scheduler and OffloadingConnector."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from kvcache_offload.integrations.vllm._hints import SESSION_END, SESSION_END_ACTION
from tests.vllm._engine import HANDLERS_API, Engine

BLOCK_BYTES = 2 * 2 * 16 * 2 * 8 * 2  # layers x K,V x tokens x heads x head size x bf16/fp16
CAPACITY = 16  # offloaded blocks


def _prompt(seed: int, blocks: int) -> list[int]:
    """``blocks`` full 16-token blocks plus 4 tokens (the partial block is never stored)."""
    return [4 + (seed * 101 + i * 37) % 500 for i in range(blocks * 16 + 4)]


def _run(engine: Engine) -> None:
    """Until idle, and the step after, where a live engine reports the finished requests."""
    engine.run_until_idle()
    engine.signal_finished()


def _loaded_tokens(engine: Engine, prompt: list[int]) -> int:
    """Tokens of ``prompt`` that a new request got from the CPU tier."""
    req = engine.add_request(prompt)
    for _ in range(100):
        output = engine.step()
        engine.wait_transfers()
        if req in output.num_scheduled_tokens:
            loaded = len(prompt) - output.num_scheduled_tokens[req]
            _run(engine)
            return loaded
    raise AssertionError("the request was never scheduled")


@pytest.mark.parametrize("hint", [True, False], ids=["session-end", "no-hint"])
def test_the_blocks_of_an_ended_session_go_before_older_ones(hint: bool) -> None:
    engine = Engine({"cpu_bytes_to_use": CAPACITY * BLOCK_BYTES, "eviction_policy": "lru"})
    try:
        manager = engine.connector_scheduler.manager._manager
        assert manager.stats().num_blocks == CAPACITY
        older, ended, filler = _prompt(1, 6), _prompt(2, 6), _prompt(3, 10)
        engine.add_request(older)
        _run(engine)
        # The newer request says this turn ends its conversation.
        engine.add_request(ended, kv_transfer_params={SESSION_END: hint})
        _run(engine)
        assert manager.stats().released == (6 if hint else 0)
        engine.add_request(filler)  # needs 6 of the 16 slots back
        _run(engine)
        assert manager.stats().evictions == 6
        assert manager.stats().released_evictions == (6 if hint else 0)
        assert engine.scheduler.reset_prefix_cache()
        # LRU alone evicts the older conversation; the hint keeps it and drops the ended one.
        assert _loaded_tokens(engine, older) == (96 if hint else 0)
    finally:
        engine.shutdown()


def test_a_block_another_request_uses_again_is_kept() -> None:
    engine = Engine({"cpu_bytes_to_use": CAPACITY * BLOCK_BYTES, "eviction_policy": "lru"})
    try:
        manager = engine.connector_scheduler.manager._manager
        shared = _prompt(4, 6)
        engine.add_request(shared, kv_transfer_params={SESSION_END: True})
        _run(engine)
        assert manager.stats().released == 6
        assert engine.scheduler.reset_prefix_cache()
        assert _loaded_tokens(engine, shared) == 96  # asked for again: unmarked
        assert manager.stats().released == 0
    finally:
        engine.shutdown()


def test_a_malformed_hint_is_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine({"cpu_bytes_to_use": CAPACITY * BLOCK_BYTES})
    try:
        manager = engine.connector_scheduler.manager._manager
        with caplog.at_level(logging.WARNING):
            engine.add_request(_prompt(5, 6), kv_transfer_params={SESSION_END: "yes"})
            _run(engine)
        assert manager.stats().stored_blocks == 6  # served as usual
        assert manager.stats().released == 0
        assert any(SESSION_END in r.getMessage() for r in caplog.records)
    finally:
        engine.shutdown()


def test_a_prefix_loaded_again_outlives_one_stored_after_it() -> None:
    # Recency reaches the policy on every vLLM release: 0.21's scheduler touches a request's
    # keys, later ones only report the request's end (on_request_finished).
    engine = Engine({"cpu_bytes_to_use": CAPACITY * BLOCK_BYTES, "eviction_policy": "lru"})
    try:
        reused, other, filler = _prompt(6, 6), _prompt(7, 6), _prompt(8, 10)
        engine.add_request(reused)
        _run(engine)
        engine.add_request(other)
        _run(engine)
        assert engine.scheduler.reset_prefix_cache()
        assert _loaded_tokens(engine, reused) == 96  # used again: now the most recent
        engine.add_request(filler)  # needs 6 of the 16 slots back: LRU takes `other`
        _run(engine)
        assert engine.scheduler.reset_prefix_cache()
        assert _loaded_tokens(engine, reused) == 96
        assert _loaded_tokens(engine, other) == 0
    finally:
        engine.shutdown()


@pytest.mark.skipif(HANDLERS_API, reason="vLLM 0.21 has no offloading metrics to report")
def test_vllm_own_cpu_tier_metrics_are_reported_under_vllm_033() -> None:
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as M

    engine = Engine({"cpu_bytes_to_use": CAPACITY * BLOCK_BYTES, "store_threshold": 2})
    try:
        spec_cls = type(engine.worker.connector_worker.spec)
        names = set(spec_cls.build_metric_definitions({"store_threshold": 2}))
        assert {M.CPU_CACHE_USAGE_PERC, M.CPU_ALLOCATION_SIZE, M.STORES_SKIPPED} <= names
        # vLLM's scheduler collects the stats every step (log_stats): keep what it got.
        manager = engine.connector_scheduler.manager
        reported: list[dict] = []
        collect = manager.get_stats
        manager.get_stats = lambda: reported.append(collect().data["data"]) or None  # type: ignore[method-assign]
        prompt = _prompt(9, 6)
        engine.add_request(prompt)  # offered once: the reuse filter skips its 6 blocks
        _run(engine)
        engine.add_request(prompt)  # offered again: stored
        _run(engine)
        assert reported
        assert sum(r[M.STORES_SKIPPED][()] for r in reported) == 6
        sizes = [s for r in reported for s in r.get(M.CPU_ALLOCATION_SIZE, {}).get((), [])]
        assert sizes == [6]
        assert reported[-1][M.CPU_CACHE_USAGE_PERC][()] == 0.0  # nothing in flight at the end
        assert manager.get_load_source(b"k", None).value == "host"
        (info,) = manager.config_info()
        assert set(info) == set(spec_cls.config_info_keys({}))
        assert info["cpu_num_chunks"] == CAPACITY
        assert info["cpu_kv_cache_size_bytes"] == CAPACITY * BLOCK_BYTES
    finally:
        engine.shutdown()


@pytest.mark.skipif(HANDLERS_API, reason="vLLM 0.21 has no kv_hints")
def test_an_orchestrators_kv_hints_action_ends_the_session_too() -> None:
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    action = KvHintAction(
        action_id="end-1", action_type=SESSION_END_ACTION, action_version="1", payload={}
    )
    envelope = KvHintsEnvelope(protocol_version="1", message_id="m-1", actions=[action])
    engine = Engine({"cpu_bytes_to_use": CAPACITY * BLOCK_BYTES, "eviction_policy": "lru"})
    try:
        manager = engine.connector_scheduler.manager._manager
        engine.add_request(_prompt(10, 6), kv_hints=envelope)
        _run(engine)
        assert manager.stats().released == 6
    finally:
        engine.shutdown()
