"""vLLM's own Scheduler and OffloadingConnector, configured only by kv_connector_extra_config,
store KV through this library, and after reset_prefix_cache load it back byte for byte."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.vllm._engine import Engine

PROMPT = [4 + (i * 37) % 500 for i in range(100)]  # 6 full 16-token blocks + 4 tokens


def _stored_then_reloaded(engine: Engine) -> None:
    engine.add_request(PROMPT)
    engine.run_until_idle()
    assert engine.scheduler.reset_prefix_cache()
    for tensor in engine.kv.values():
        tensor.zero_()  # what comes back can only come from the CPU tier

    req = engine.add_request(PROMPT)
    for _ in range(100):
        output = engine.step()
        engine.wait_transfers()
        if req in output.num_scheduled_tokens:
            break
    else:
        raise AssertionError("the second request was never scheduled")
    # Only the tail is computed: 96 tokens came from the CPU tier.
    assert output.num_scheduled_tokens[req] == len(PROMPT) - 96
    (block_ids,) = engine.scheduler.kv_cache_manager.get_block_ids(req)
    for index in range(96 // engine.block_size):
        got = engine.block_bytes(block_ids[index])
        want = engine.expected_block(PROMPT, index)
        for layer in engine.layers:
            assert got[layer].tolist() == want[layer].tolist(), (index, layer)
    engine.run_until_idle()


@pytest.mark.parametrize(
    "extra",
    [
        {"cpu_bytes_to_use": 1 << 20, "eviction_policy": "lru"},
        {"cpu_bytes_to_use": "1MiB", "eviction_policy": "arc", "block_size": 32},
        {"cpu_bytes_to_use": 1 << 20, "eviction_policy": "s3fifo", "store_threshold": 0},
    ],
    ids=["lru", "arc-2-gpu-blocks-per-offloaded-block", "s3fifo"],
)
def test_vllm_stores_then_loads_every_byte_back_through_our_spec(extra: dict) -> None:
    engine = Engine(extra)
    try:
        _stored_then_reloaded(engine)
    finally:
        engine.shutdown()


def test_the_scheduler_runs_our_manager_and_the_worker_our_handlers() -> None:
    from kvcache_offload.contracts.handler import OffloadingHandler
    from kvcache_offload.contracts.manager import OffloadingManager

    engine = Engine({"cpu_bytes_to_use": 1 << 20})
    try:
        manager = engine.connector_scheduler.manager
        assert isinstance(manager._manager, OffloadingManager)
        spec = engine.worker.connector_worker.spec
        store, load = spec.backend.handlers(None)  # cached: the pair vLLM's worker drives
        assert isinstance(store, OffloadingHandler) and isinstance(load, OffloadingHandler)
        engine.add_request(PROMPT)
        engine.run_until_idle()
        assert manager._manager.stats().stored_blocks == 96 // engine.block_size
    finally:
        engine.shutdown()
