"""Stores, evictions and resets driven through the HTTP API appear on the ZMQ socket in order."""

from __future__ import annotations

from typing import Any

from kvcache_offload.keys import chained_block_hashes
from kvcache_offload.kv_events import external_block_hash
from tests.unit._api_app import hex_key, served, small_config, store
from tests.unit._kv_subscriber import DocSubscriber

ANY_PORT = "tcp://127.0.0.1:*"


def wire_hash(hex_offload_key: str) -> int:
    return external_block_hash(bytes.fromhex(hex_offload_key)[:-4], "int")


def describe(event: Any) -> tuple[Any, ...]:
    kind = type(event).__name__
    if kind == "BlockStored":
        return (kind, event.block_hashes, event.parent_block_hash, event.token_ids, event.medium)
    if kind == "BlockRemoved":
        return (kind, event.block_hashes, event.medium)
    return (kind,)


async def test_http_stores_evictions_and_resets_are_published_in_order() -> None:
    config = small_config(
        kv_events_endpoint=ANY_PORT, kv_events_replay_endpoint=ANY_PORT, kv_events_topic="kv"
    )
    async with served(config) as s:
        pub = s.engine.kv_events
        assert pub is not None and pub.replay_endpoint is not None
        sub = DocSubscriber(pub.endpoint, pub.replay_endpoint, "kv")
        try:
            expected: list[tuple[Any, ...]] = []
            for start in range(0, 20, 4):  # 20 blocks into a 16-block tier: 4 evictions
                keys = [hex_key(i) for i in range(start, start + 4)]
                prepared = await store(s.client, keys)
                if prepared["evicted_keys"]:
                    hashes = [wire_hash(k) for k in prepared["evicted_keys"]]
                    expected.append(("BlockRemoved", hashes, "CPU"))
                hashes = [wire_hash(k) for k in prepared["keys_to_store"]]
                expected.append(("BlockStored", hashes, None, [], "CPU"))
            for _ in range(2):  # a reset of an empty tier is published too
                assert (await s.client.post("/v1/reset")).status_code == 200
                expected.append(("AllBlocksCleared",))
            # A store named by token ids carries the tokens and the chain's parent.
            tokens = list(range(48))
            body = {"token_ids": tokens, "block_size": 16}
            prepared = (await s.client.post("/v1/store/prepare", json=body)).json()
            await s.client.post("/v1/store/complete", json={"lease_id": prepared["lease_id"]})
            hashes = [external_block_hash(h, "int") for h in chained_block_hashes(tokens, 16)]
            expected.append(("BlockStored", hashes, None, tokens, "CPU"))
            longer = {"token_ids": [*tokens, *range(900, 916)], "block_size": 16}
            prepared = (await s.client.post("/v1/store/prepare", json=longer)).json()
            assert len(prepared["keys_to_store"]) == 1
            await s.client.post("/v1/store/complete", json={"lease_id": prepared["lease_id"]})
            expected.append(
                (
                    "BlockStored",
                    [wire_hash(prepared["keys_to_store"][0])],
                    hashes[-1],
                    list(range(900, 916)),
                    "CPU",
                )
            )
            await sub.collect(lambda got: len(got.events) >= len(expected))
            assert [describe(e) for e in sub.events] == expected
            metrics = (await s.client.get("/metrics")).text
            assert f"kvcache_offload_kv_events_published_total {float(len(expected))}" in metrics
        finally:
            sub.close()


async def test_a_large_token_id_store_publishes_exactly_its_tokens() -> None:
    """Over 64 KiB of ids, the service parses them into an array and makes the publisher's
    Python ints in a worker thread; the published blocks are still exactly the ids sent."""
    config = small_config(
        kv_events_endpoint=ANY_PORT, kv_events_replay_endpoint=ANY_PORT, kv_events_topic="kv"
    )
    tokens = [(i * 7919) % 152_000 for i in range(70_000)]  # two blocks of 32,768, a tail
    async with served(config) as s:
        pub = s.engine.kv_events
        assert pub is not None and pub.replay_endpoint is not None
        sub = DocSubscriber(pub.endpoint, pub.replay_endpoint, "kv")
        try:
            body = {"token_ids": tokens, "block_size": 32_768}
            prepared = (await s.client.post("/v1/store/prepare", json=body)).json()
            assert len(prepared["keys_to_store"]) == 2
            await s.client.post("/v1/store/complete", json={"lease_id": prepared["lease_id"]})
            await sub.collect(lambda got: len(got.events) >= 1)
            (stored,) = sub.events
            assert describe(stored)[3] == tokens[: 2 * 32_768]
        finally:
            sub.close()
