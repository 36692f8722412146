"""``kvcache-offload serve --kv-events-endpoint``: a real server process publishing to a router."""

from __future__ import annotations

import signal

from kvcache_offload.client import OffloadClient
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.kv_events import external_block_hash
from tests.integration._server import CAPACITY_BLOCKS, free_port, running_server
from tests.unit._kv_subscriber import DocSubscriber


def key(i: int) -> OffloadKey:
    return OffloadKey(i.to_bytes(8, "big") + b"\0\0\0\0")


async def test_served_stores_evictions_and_reset_reach_a_subscriber_by_flags_and_env() -> None:
    pub_port, replay_port = free_port(), free_port()
    args = (
        "--kv-events-endpoint", f"tcp://*:{pub_port}",
        "--kv-events-replay-endpoint", f"tcp://*:{replay_port}",
        "--kv-events-topic", "kv-events",
        "--policy", "lru",  # the eviction below is LRU's: key 0
    )  # fmt: skip
    env = {"KVCACHE_OFFLOAD_KV_EVENTS_ENCODING": "map"}
    with running_server(*args, env=env) as server:
        sub = DocSubscriber(
            f"tcp://127.0.0.1:{pub_port}",
            f"tcp://127.0.0.1:{replay_port}",
            topic="kv-events",
            encoding="map",
        )
        try:
            async with OffloadClient(server.url) as client:
                for i in range(CAPACITY_BLOCKS + 1):  # one more than fits: one eviction
                    lease = await client.prepare_store([key(i)])
                    await client.complete_store(lease.lease_id)
                await client.reset()
            await sub.collect(
                lambda s: any(type(e).__name__ == "AllBlocksCleared" for e in s.events)
            )
            kinds = [type(e).__name__ for e in sub.events]
            assert kinds == ["BlockStored"] * CAPACITY_BLOCKS + [
                "BlockRemoved",
                "BlockStored",
                "AllBlocksCleared",
            ]
            assert sub.events[CAPACITY_BLOCKS].block_hashes == [
                external_block_hash(key(0)[:-4], "int")
            ]
            assert [e.block_hashes for e in sub.events[:3]] == [[0], [1], [2]]
        finally:
            sub.close()
        code = server.stop()
        output = server.process.stdout.read().decode() if server.process.stdout else ""
    # uvicorn re-raises the caught SIGTERM after a clean shutdown, hence -SIGTERM.
    assert code in (0, -signal.SIGTERM), output
    assert "KV-event" not in output, output
