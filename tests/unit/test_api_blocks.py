"""Block bytes over HTTP (remote mode): exact sizes, round trips, states, limits."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from kvcache_offload.aio import OffloadEngine
from kvcache_offload_service import create_app
from tests.unit._aio_fakes import BLOCK_BYTES, FakeSpec
from tests.unit._aio_fakes import small_config as fake_config
from tests.unit._api_app import hex_key


@asynccontextmanager
async def block_client(**overrides: object) -> AsyncIterator[httpx.AsyncClient]:
    config = fake_config(num_blocks=4, **overrides)
    async with OffloadEngine(config, spec=FakeSpec(config)) as engine:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            yield client


async def _put(client: httpx.AsyncClient, keys: list[str], body: bytes) -> httpx.Response:
    return await client.put(
        "/v1/blocks",
        params=[("keys", k) for k in keys],
        content=body,
        headers={"content-type": "application/octet-stream"},
    )


async def test_blocks_round_trip_byte_for_byte() -> None:
    async with block_client() as client:
        blobs = [bytes(range(i, i + BLOCK_BYTES)) for i in range(3)]
        keys = [hex_key(i) for i in range(3)]
        r = await _put(client, keys, b"".join(blobs))
        assert r.status_code == 200, r.text
        assert r.json()["keys_stored"] == keys
        assert r.json()["transfer_bytes"] == 3 * BLOCK_BYTES
        for key, blob in zip(keys, blobs, strict=True):
            got = await client.get(f"/v1/blocks/{key}")
            assert got.status_code == 200
            assert got.headers["content-type"] == "application/octet-stream"
            assert got.content == blob
        r = await client.post("/v1/lookup", json={"keys": keys})
        assert r.json()["hits"] == 3


async def test_body_of_the_wrong_size_is_refused_and_stores_nothing() -> None:
    async with block_client() as client:
        for body in (b"", b"x" * (BLOCK_BYTES - 1), b"x" * (2 * BLOCK_BYTES)):
            r = await _put(client, [hex_key(1)], body)
            assert r.status_code == 422, r.text
            assert str(BLOCK_BYTES) in r.json()["detail"]
        r = await client.post("/v1/lookup", json={"keys": [hex_key(1)]})
        assert r.json()["states"] == ["absent"]


async def test_reading_an_absent_block_answers_409() -> None:
    async with block_client() as client:
        r = await client.get(f"/v1/blocks/{hex_key(9)}")
        assert r.status_code == 409
        assert r.json()["error"] == "BlockStateError"


async def test_malformed_block_keys_answer_422() -> None:
    async with block_client() as client:
        assert (await client.get("/v1/blocks/xyz")).status_code == 422
        assert (await _put(client, ["nothex"], b"x" * BLOCK_BYTES)).status_code == 422
        assert (await client.put("/v1/blocks", content=b"x" * BLOCK_BYTES)).status_code == 422


async def test_uploads_beyond_capacity_evict_the_oldest_blocks() -> None:
    async with block_client(eviction_policy="lru") as client:
        keys = [hex_key(i) for i in range(5)]
        for key in keys:
            r = await _put(client, [key], b"z" * BLOCK_BYTES)
            assert r.status_code == 200
        assert r.json()["evicted_keys"] == [keys[0]]


async def test_too_many_keys_in_one_upload_answer_422() -> None:
    async with block_client(max_keys_per_request=2) as client:
        keys = [hex_key(i) for i in range(3)]
        r = await _put(client, keys, b"x" * (3 * BLOCK_BYTES))
        assert r.status_code == 422
        assert "max_keys_per_request=2" in r.json()["detail"]
