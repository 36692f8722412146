"""Inside vLLM, ``observability_port`` serves this library's /metrics, /v1/events, lookup and
stats on a side port, fed by vLLM's real Scheduler and OffloadingConnector driving our spec."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("vllm")

from tests._ports import free_port
from tests.vllm._engine import Engine
from tests.vllm._side_port_client import port_is_free, read_events, sample, scrape

PROMPT = [4 + (i * 37) % 500 for i in range(100)]  # 6 full 16-token blocks + 4 tokens
BLOCKS = 96 // 16
BLOCK_BYTES = 2048  # 2 layers x K/V x 16 tokens x 2 heads x 8 dims x 2 bytes


def test_vllms_offloading_shows_on_the_side_port_and_the_port_is_freed_at_shutdown() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = Engine({"cpu_bytes_to_use": 1 << 20, "observability_port": port})
    try:
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
        assert sample(scrape(url), "kvcache_offload_store_blocks_completed_total") == 0

        engine.add_request(PROMPT)
        engine.run_until_idle()
        stored = scrape(url)
        assert sample(stored, "kvcache_offload_store_blocks_completed_total") == BLOCKS
        assert sample(stored, "kvcache_offload_blocks", state="idle") == BLOCKS
        assert sample(stored, "kvcache_offload_capacity_blocks") == (1 << 20) // BLOCK_BYTES
        assert (
            sample(stored, "kvcache_offload_transfer_bytes_total", direction="gpu_to_cpu")
            == BLOCKS * BLOCK_BYTES
        )

        # reset_prefix_cache, then the same prompt: vLLM loads its 6 blocks from our tier.
        assert engine.scheduler.reset_prefix_cache()
        engine.add_request(PROMPT)
        engine.run_until_idle()
        loaded = scrape(url)
        assert sample(loaded, "kvcache_offload_load_blocks_completed_total") == BLOCKS
        assert sample(loaded, "kvcache_offload_lookup_hit_blocks_total") >= BLOCKS
        assert (
            sample(loaded, "kvcache_offload_transfer_bytes_total", direction="cpu_to_gpu")
            == BLOCKS * BLOCK_BYTES
        )

        events = read_events(url, 2)
        assert [e["type"] for e in events] == ["stored", "load_completed"]
        keys = events[0]["keys"]
        assert len(keys) == BLOCKS and sorted(events[1]["keys"]) == sorted(keys)

        answer = httpx.post(f"{url}/v1/lookup", json={"keys": keys}, timeout=10).json()
        assert answer["hits"] == BLOCKS
        stats = httpx.get(f"{url}/v1/stats", timeout=10).json()
        assert stats["store_blocks_completed"] == BLOCKS
        assert stats["load_blocks_completed"] == BLOCKS
        assert httpx.post(f"{url}/v1/reset", timeout=10).status_code == 404
    finally:
        engine.shutdown()
    assert port_is_free("127.0.0.1", port)
