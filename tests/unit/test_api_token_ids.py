"""Large ``token_ids`` bodies: the sliced decoder gives what a small body gives, within limits."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from kvcache_offload.keys import token_block_keys
from kvcache_offload_service.limits import MAX_JSON_BODY_BYTES, MAX_TOKEN_IDS, BodyLimitMiddleware
from kvcache_offload_service.routes import _keys, _token_body
from tests.unit._api_app import served, small_config

IDS = np.random.default_rng(13).integers(-3, 152_000, 90_000).tolist()  # ~600 KB of JSON


def _expected(
    ids: list[int], block_size: int, group_idx: int = 0, salt: str | None = None
) -> list[str]:
    return [k.hex() for k in token_block_keys(ids, block_size, group_idx, salt)]


@pytest.mark.parametrize(
    "body",
    [
        {"token_ids": IDS, "block_size": 32},
        {"block_size": 64, "salt": 'a "token_ids": [1] salt', "group_idx": 3, "token_ids": IDS},
        {"req_id": "r1", "token_ids": IDS, "block_size": 1000, "salt": "tenant"},
    ],
)
@pytest.mark.parametrize("indent", [None, 2])
async def test_a_large_token_id_lookup_derives_the_keys_a_small_body_would(
    body: dict[str, Any], indent: int | None
) -> None:
    raw = json.dumps(body, indent=indent).encode()
    assert len(raw) > _keys.OFF_LOOP_BYTES  # the sliced path
    async with served() as s:
        r = await s.client.post(
            "/v1/lookup", content=raw, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 200, r.text
        expected = _expected(IDS, body["block_size"], body.get("group_idx", 0), body.get("salt"))
        assert r.json()["keys"] == expected
        assert r.json()["hits"] == 0 and len(r.json()["states"]) == len(expected)
        touched = await s.client.post("/v1/touch", content=raw)  # the other key route
        assert touched.json() == {"touched": len(expected)}


async def test_more_token_ids_than_a_request_may_send_is_a_clear_413(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_token_body, "MAX_TOKEN_IDS", 50_000)
    async with served() as s:
        r = await s.client.post("/v1/lookup", json={"token_ids": IDS, "block_size": 1 << 20})
    assert r.status_code == 413
    assert r.json()["error"] == "RequestTooLarge"
    assert "more than 50,000 token ids" in r.json()["detail"]


@pytest.mark.parametrize(
    ("bad", "message"),
    [("7.5", "must be integers"), (str(2**31), "signed 32-bit"), ('"x"', "must be integers")],
)
async def test_a_bad_id_in_a_large_body_is_a_422_naming_its_index(bad: str, message: str) -> None:
    ids = ",".join(map(str, IDS)).encode()
    cut = ids.index(b",", 400_000)
    raw = b'{"block_size": 16, "token_ids": [' + ids[:cut] + b"," + bad.encode() + ids[cut:] + b"]}"
    async with served() as s:
        r = await s.client.post("/v1/lookup", content=raw)
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"][:2] == ["body", "token_ids"] and message in error["msg"]
    assert error["loc"][2] == ids[:cut].count(b",") + 1  # the index of the bad id


async def test_an_oversized_body_of_hex_keys_is_a_413_instead_of_a_long_parse() -> None:
    config = small_config(max_keys_per_request=8)
    keys = [f"{i:072x}" for i in range(5_000)]  # ~385 KB, far more than 8 keys need
    async with served(config) as s:
        r = await s.client.post("/v1/lookup", json={"keys": keys})
    assert r.status_code == 413
    assert "larger than 8 keys need" in r.json()["detail"]


async def test_json_bodies_over_the_token_id_room_are_refused_before_reading() -> None:
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the app must not run")

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body must not be read")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    middleware = BodyLimitMiddleware(app, max_bytes=1 << 30)
    length = str(MAX_JSON_BODY_BYTES + 1).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/lookup",
             "headers": [(b"content-length", length)]}  # fmt: skip
    await middleware(scope, receive, send)
    assert sent[0]["status"] == 413
    detail = json.loads(sent[1]["body"])["detail"]
    assert f"{MAX_TOKEN_IDS:,} token ids" in detail
