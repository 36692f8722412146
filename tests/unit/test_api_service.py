"""Auth, health, readiness, stats, region and the OpenAPI document."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import httpx
import pytest

from kvcache_offload.aio.types import EngineStats, LoadLease, LookupResult, StoreLease, StoreResult
from kvcache_offload.aio.wire import from_wire
from kvcache_offload.errors import LeaseExpiredError, OffloadError
from kvcache_offload_service import create_app
from kvcache_offload_service.errors import EngineNotReady, TooManySubscribers
from kvcache_offload_service.limits import RequestLimitError
from tests.unit._api_app import BLOCK_BYTES, hex_key, served, small_config, store

TOKEN = "s3cret-token"


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}],
)
async def test_v1_routes_refuse_requests_without_the_right_token(headers: dict[str, str]) -> None:
    async with served(small_config(api_token=TOKEN)) as s:
        for method, path in (("POST", "/v1/lookup"), ("GET", "/v1/stats"), ("GET", "/v1/events")):
            r = await s.client.request(method, path, json={"keys": [hex_key(1)]}, headers=headers)
            assert r.status_code == 401, (path, r.text)
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert r.json()["error"] == "Unauthorized"


async def test_the_right_token_opens_v1_and_health_and_metrics_stay_open() -> None:
    async with served(small_config(api_token=TOKEN)) as s:
        r = await s.client.post(
            "/v1/lookup",
            json={"keys": [hex_key(1)]},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 200
        for path in ("/healthz", "/readyz", "/metrics"):
            assert (await s.client.get(path)).status_code == 200


async def test_stats_report_engine_counters_as_json() -> None:
    async with served() as s:
        await store(s.client, [hex_key(1), hex_key(2)])
        r = await s.client.get("/v1/stats")
        assert r.status_code == 200
        body = r.json()
        assert body["store_blocks_completed"] == 2
        assert body["capacity_blocks"] == 16
        assert body["policy"] == "adaptive"  # the default


async def test_region_answers_404_when_the_server_has_no_shared_region() -> None:
    async with served(small_config(shared_region=False)) as s:
        r = await s.client.get("/v1/region")
        assert r.status_code == 404
        assert "no shared region" in r.json()["detail"]


async def test_readyz_is_503_until_the_owned_engine_started() -> None:
    app = create_app(small_config())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.get("/readyz")).status_code == 503
        r = await client.post("/v1/lookup", json={"keys": [hex_key(1)]})
        assert r.status_code == 503 and r.json()["error"] == "EngineNotReady"
        async with app.router.lifespan_context(app):
            assert (await client.get("/readyz")).status_code == 200
            r = await client.post("/v1/lookup", json={"keys": [hex_key(1)]})
            assert r.status_code == 200
        assert app.state.engine is None
        assert (await client.get("/readyz")).status_code == 503


async def test_openapi_documents_every_route() -> None:
    async with served() as s:
        paths = (await s.client.get("/openapi.json")).json()["paths"]
    for path in (
        "/v1/lookup",
        "/v1/touch",
        "/v1/discard",
        "/v1/release",
        "/v1/store/prepare",
        "/v1/store/complete",
        "/v1/load/prepare",
        "/v1/load/complete",
        "/v1/blocks",
        "/v1/blocks/{key}",
        "/v1/region",
        "/v1/events",
        "/v1/stats",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert path in paths, path


async def test_unknown_route_answers_404_json() -> None:
    async with served() as s:
        r = await s.client.get("/v1/nope")
        assert r.status_code == 404
        assert r.json()["error"] == "HTTPError"


async def test_openapi_declares_bearer_auth_on_v1_routes_when_a_token_is_set() -> None:
    async with served(small_config(api_token=TOKEN)) as s:
        doc = (await s.client.get("/openapi.json")).json()
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert doc["paths"]["/v1/lookup"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/healthz"]["get"]


async def test_owned_engine_records_requests_and_exports_the_miss_ratio_curve(
    tmp_path: Path,
) -> None:
    record = tmp_path / "requests.jsonl"
    app = create_app(small_config(record_path=record, mrc_sample_rate=1.0))
    transport = httpx.ASGITransport(app=app)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://t") as client,
        app.router.lifespan_context(app),
    ):
        keys = [hex_key(i) for i in range(4)]
        for _ in range(3):
            await client.post("/v1/lookup", json={"keys": keys})
            await store(client, keys)
        text = (await client.get("/metrics")).text
    assert 'kvcache_offload_mrc_hit_ratio{scale="1"}' in text
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [line["op"] for line in lines if line["op"] == "lookup"] == ["lookup"] * 3
    assert lines[0]["keys"] == keys


async def test_readyz_is_503_once_a_served_engine_is_closed() -> None:
    async with served() as s:
        assert (await s.client.get("/readyz")).status_code == 200
        await s.engine.aclose()
        assert (await s.client.get("/readyz")).status_code == 503


async def test_an_unexpected_error_is_still_a_json_500() -> None:
    async with served() as s:

        async def out_of_memory(*args: object, **kwargs: object) -> None:
            raise MemoryError("cannot allocate")

        s.engine.write_blocks = out_of_memory  # type: ignore[method-assign]
        transport = httpx.ASGITransport(app=s.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            r = await client.put(
                "/v1/blocks", params={"keys": [hex_key(1)]}, content=bytes(BLOCK_BYTES)
            )
        assert r.status_code == 500
        assert r.json() == {"error": "InternalError", "detail": "MemoryError: cannot allocate"}


async def test_stats_state_the_block_size_in_bytes() -> None:
    async with served() as s:
        stats = (await s.client.get("/v1/stats")).json()
        assert stats["block_nbytes"] == BLOCK_BYTES == s.engine.block_nbytes


async def test_a_malformed_key_is_explained_not_shown_as_a_regex() -> None:
    async with served() as s:
        r = await s.client.post("/v1/lookup", json={"keys": ["xyz"]})
        assert r.status_code == 422
        (error,) = r.json()["detail"]
        assert "hex" in error["msg"] and "group index" in error["msg"]
        assert "^(" not in error["msg"]


async def test_a_body_of_the_wrong_size_is_not_called_too_large() -> None:
    async with served() as s:
        r = await s.client.put("/v1/blocks", params={"keys": [hex_key(1)]}, content=b"12345")
        assert r.status_code == 422
        assert r.json()["error"] == "InvalidRequest"
        assert f"1 x {BLOCK_BYTES}" in r.json()["detail"]


async def test_client_region_raises_a_region_error_and_lookup_keeps_derived_keys() -> None:
    from kvcache_offload.client import OffloadClient
    from kvcache_offload.errors import RegionError
    from kvcache_offload.keys import token_block_keys

    async with served(small_config(shared_region=False)) as s:
        transport = httpx.ASGITransport(app=s.app)
        async with OffloadClient("http://test", transport=transport) as client:
            with pytest.raises(RegionError, match="no shared region"):
                await client.region()
            tokens = list(range(32))
            result = await client.lookup(token_ids=tokens, block_size=16)
            assert result.keys == token_block_keys(tokens, 16)
            assert (await client.lookup([hex_key(1)])).keys is None


def test_a_config_file_of_an_unknown_type_is_named_not_parsed_as_json(tmp_path: Path) -> None:
    from kvcache_offload.config import load_config
    from kvcache_offload.errors import ConfigError

    ini = tmp_path / "offload.ini"
    ini.write_text("[kvcache_offload]\nport = 1\n")
    with pytest.raises(ConfigError, match=r"unknown type '\.ini': use \.toml, \.json"):
        load_config(ini)


async def test_openapi_response_schemas_are_the_engines_own_result_types() -> None:
    """One definition per wire shape: the schema shows exactly the dataclass's fields."""
    async with served() as s:
        doc = (await s.client.get("/openapi.json")).json()
    for path, method, cls in (
        ("/v1/lookup", "post", LookupResult),
        ("/v1/store/prepare", "post", StoreLease),
        ("/v1/load/prepare", "post", LoadLease),
        ("/v1/blocks", "put", StoreResult),
        ("/v1/stats", "get", EngineStats),
    ):
        answer = doc["paths"][path][method]["responses"]["200"]["content"]["application/json"]
        schema = doc["components"]["schemas"][answer["schema"]["$ref"].rsplit("/", 1)[1]]
        assert set(schema["properties"]) == {f.name for f in fields(cls)}, path
    lease_keys = doc["components"]["schemas"]["StoreLease"]["properties"]["keys_to_store"]
    assert lease_keys["items"]["type"] == "string"  # keys travel as hex


async def test_stats_answer_decodes_to_the_engines_stats() -> None:
    async with served() as s:
        await store(s.client, [hex_key(1)])
        answer = from_wire(EngineStats, (await s.client.get("/v1/stats")).json())
        assert answer.store_blocks_completed == s.engine.stats().store_blocks_completed == 1


def test_service_errors_are_offload_errors() -> None:
    for cls in (EngineNotReady, TooManySubscribers, RequestLimitError, LeaseExpiredError):
        assert issubclass(cls, OffloadError), cls
