"""Sidecar prepare/complete flows over HTTP, and how their failures map to statuses."""

from __future__ import annotations

from kvcache_offload.aio import EventType
from tests.unit._api_app import CAPACITY_BLOCKS, hex_key, served, small_config, store, wait_for


async def test_store_then_load_flow_pins_and_releases_blocks() -> None:
    async with served() as s:
        keys = [hex_key(i) for i in range(3)]
        lease = await store(s.client, keys)
        assert lease["keys_to_store"] == keys
        assert len(set(lease["block_ids"])) == 3
        r = await s.client.post("/v1/load/prepare", json={"keys": keys, "ttl_s": 5})
        assert r.status_code == 200, r.text
        load = r.json()
        assert load["keys"] == keys and load["block_ids"] == lease["block_ids"]
        assert s.engine.stats().blocks_reading == 3
        r = await s.client.post("/v1/load/complete", json={"lease_id": load["lease_id"]})
        assert r.status_code == 200
        assert s.engine.stats().blocks_reading == 0
        assert s.engine.stats().leases_active == 0


async def test_failed_store_completion_leaves_nothing_loadable() -> None:
    async with served() as s:
        r = await s.client.post("/v1/store/prepare", json={"keys": [hex_key(1)]})
        r = await s.client.post(
            "/v1/store/complete", json={"lease_id": r.json()["lease_id"], "success": False}
        )
        assert r.status_code == 200 and r.json()["keys"] == []
        r = await s.client.post("/v1/lookup", json={"keys": [hex_key(1)]})
        assert r.json()["states"] == ["absent"]


async def test_already_stored_keys_are_not_prepared_again() -> None:
    async with served() as s:
        await store(s.client, [hex_key(1)])
        r = await s.client.post("/v1/store/prepare", json={"keys": [hex_key(1), hex_key(2)]})
        assert r.json()["keys_to_store"] == [hex_key(2)]


async def test_store_beyond_capacity_with_everything_pinned_answers_507() -> None:
    async with served() as s:
        keys = [hex_key(i) for i in range(CAPACITY_BLOCKS)]
        r = await s.client.post("/v1/store/prepare", json={"keys": keys})
        assert r.status_code == 200
        r = await s.client.post("/v1/store/prepare", json={"keys": [hex_key(999)]})
        assert r.status_code == 507
        assert r.json()["error"] == "CapacityError"


async def test_eviction_returns_the_evicted_keys() -> None:
    async with served(small_config(eviction_policy="lru")) as s:
        keys = [hex_key(i) for i in range(CAPACITY_BLOCKS)]
        await store(s.client, keys)
        r = await s.client.post("/v1/store/prepare", json={"keys": [hex_key(999)]})
        assert r.status_code == 200
        assert r.json()["evicted_keys"] == [keys[0]]  # LRU


async def test_loading_an_absent_block_answers_409() -> None:
    async with served() as s:
        r = await s.client.post("/v1/load/prepare", json={"keys": [hex_key(5)]})
        assert r.status_code == 409
        assert r.json()["error"] == "BlockStateError"


async def test_unknown_lease_answers_404_and_double_completion_too() -> None:
    async with served() as s:
        r = await s.client.post("/v1/store/complete", json={"lease_id": "nope"})
        assert r.status_code == 404 and r.json()["error"] == "LeaseError"
        lease = await store(s.client, [hex_key(1)])
        r = await s.client.post("/v1/store/complete", json={"lease_id": lease["lease_id"]})
        assert r.status_code == 404
        r = await s.client.post("/v1/load/complete", json={"lease_id": lease["lease_id"]})
        assert r.status_code == 404


async def test_expired_lease_answers_410_and_is_published_as_an_event() -> None:
    async with served() as s:
        async with s.engine.subscribe([EventType.LEASE_EXPIRED]) as events:
            r = await s.client.post("/v1/store/prepare", json={"keys": [hex_key(1)], "ttl_s": 0.05})
            lease_id = r.json()["lease_id"]
            await wait_for(lambda: s.engine.stats().leases_expired.get("store") == 1)
            event = await events.__anext__()
        assert event.type is EventType.LEASE_EXPIRED
        assert event.detail["lease_id"] == lease_id
        r = await s.client.post("/v1/store/complete", json={"lease_id": lease_id})
        assert r.status_code == 410
        r = await s.client.post("/v1/lookup", json={"keys": [hex_key(1)]})
        assert r.json()["states"] == ["absent"]  # rolled back: nothing pinned


async def test_lease_ttl_out_of_range_answers_422() -> None:
    async with served() as s:
        for ttl in (0, -1, 10**9):
            r = await s.client.post("/v1/store/prepare", json={"keys": [hex_key(1)], "ttl_s": ttl})
            assert r.status_code == 422


async def test_reset_drops_every_block() -> None:
    async with served() as s:
        await store(s.client, [hex_key(1)])
        r = await s.client.post("/v1/reset")
        assert r.status_code == 200
        r = await s.client.post("/v1/lookup", json={"keys": [hex_key(1)]})
        assert r.json()["hits"] == 0


async def test_the_sidecar_store_flow_is_refused_with_409_without_a_shared_region() -> None:
    """Without a region the client could not write the blocks: they would be served as zeros."""
    async with served(small_config(shared_region=False)) as s:
        r = await s.client.post("/v1/store/prepare", json={"keys": [hex_key(1)]})
        assert r.status_code == 409
        body = r.json()
        assert body["error"] == "NoSharedRegionError"
        assert "--shared-region" in body["detail"] and "PUT /v1/blocks" in body["detail"]
        lookup = await s.client.post("/v1/lookup", json={"keys": [hex_key(1)]})
        assert lookup.json()["states"] == ["absent"]
        assert s.engine.stats().leases_active == 0
