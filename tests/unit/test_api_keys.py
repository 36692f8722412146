"""Lookup/touch over HTTP, key derivation from token ids, and input validation."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache_offload.keys import KEY_HASH_DOMAIN, chained_block_hashes, token_block_keys
from tests.unit._api_app import hex_key, served, small_config, store


def test_chained_hash_matches_the_documented_recipe() -> None:
    tokens = [1, 2, 3, 4, -5, 6, 7]
    root = hashlib.sha256(KEY_HASH_DOMAIN + b"tenant").digest()
    h0 = hashlib.sha256(root + struct.pack("<3i", 1, 2, 3)).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<3i", 4, -5, 6)).digest()
    assert chained_block_hashes(tokens, 3, salt="tenant") == [h0, h1]  # token 7 is a partial block
    keys = token_block_keys(tokens, 3, group_idx=2, salt="tenant")
    assert keys == [h0 + b"\0\0\0\2", h1 + b"\0\0\0\2"]


def test_keys_name_the_whole_prefix_and_the_salt() -> None:
    a = token_block_keys([1, 2, 3, 4], 2)
    b = token_block_keys([9, 2, 3, 4], 2)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert token_block_keys([1, 2, 3, 4], 2, salt="x") != a


@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=64),
    block_size=st.integers(1, 8),
    cut=st.integers(0, 64),
)
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(
    tokens: list[int], block_size: int, cut: int
) -> None:
    full = token_block_keys(tokens, block_size)
    assert len(full) == len(tokens) // block_size
    assert token_block_keys(tokens[:cut], block_size) == full[: min(cut, len(tokens)) // block_size]


def test_token_ids_outside_int32_are_refused() -> None:
    from kvcache_offload.errors import InvalidKeyError

    with pytest.raises(InvalidKeyError):
        token_block_keys([2**31], 1)


async def test_lookup_reports_the_ready_prefix_after_a_store() -> None:
    async with served() as s:
        keys = [hex_key(i) for i in range(4)]
        await store(s.client, keys[:2])
        r = await s.client.post("/v1/lookup", json={"keys": keys})
        assert r.status_code == 200
        assert r.json() == {
            "hits": 2,
            "pending": False,
            "states": ["ready", "ready", "absent", "absent"],
        }


async def test_lookup_by_token_ids_derives_and_returns_the_chained_keys() -> None:
    async with served() as s:
        tokens = list(range(40))
        expected = [k.hex() for k in token_block_keys(tokens, 16, group_idx=1, salt="s")]
        await store(s.client, expected[:1])
        body = {"token_ids": tokens, "block_size": 16, "group_idx": 1, "salt": "s"}
        r = await s.client.post("/v1/lookup", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["keys"] == expected
        assert r.json()["hits"] == 1


async def test_lookup_sees_a_store_in_flight_as_pending() -> None:
    async with served() as s:
        keys = [hex_key(i) for i in range(2)]
        r = await s.client.post("/v1/store/prepare", json={"keys": keys})
        assert r.status_code == 200
        r = await s.client.post("/v1/lookup", json={"keys": keys})
        assert r.json() == {"hits": 0, "pending": True, "states": ["writing", "writing"]}


async def test_touch_answers_how_many_keys_it_touched() -> None:
    async with served() as s:
        r = await s.client.post("/v1/touch", json={"keys": [hex_key(1), hex_key(2)]})
        assert r.status_code == 200
        assert r.json() == {"touched": 2}


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"keys": [hex_key(1)], "token_ids": [1, 2]},
        {"token_ids": [1, 2]},
        {"keys": ["zz" * 12]},
        {"keys": ["abc"]},
        {"keys": ["00" * 3]},
        {"keys": [hex_key(1)], "unexpected": 1},
        {"token_ids": [1, 2], "block_size": 0},
        {"token_ids": [2**40], "block_size": 1},
        {"keys": "not a list"},
    ],
)
async def test_malformed_lookup_bodies_answer_422_with_a_message(body: dict[str, object]) -> None:
    async with served() as s:
        r = await s.client.post("/v1/lookup", json=body)
        assert r.status_code == 422, r.text
        assert r.json()["error"] == "ValidationError"
        assert r.json()["detail"]


async def test_non_json_body_answers_422() -> None:
    async with served() as s:
        r = await s.client.post(
            "/v1/lookup", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 422


async def test_too_many_keys_answer_422_naming_the_limit() -> None:
    async with served(small_config(max_keys_per_request=3)) as s:
        r = await s.client.post("/v1/lookup", json={"keys": [hex_key(i) for i in range(4)]})
        assert r.status_code == 422
        assert "max_keys_per_request=3" in r.json()["detail"]
        r = await s.client.post("/v1/lookup", json={"token_ids": list(range(8)), "block_size": 2})
        assert r.status_code == 422


async def test_oversized_body_answers_413_before_it_is_read() -> None:
    async with served(small_config(max_body_bytes=1000)) as s:
        r = await s.client.post("/v1/lookup", json={"keys": [hex_key(i) for i in range(100)]})
        assert r.status_code == 413
        assert "max_body_bytes=1000" in r.json()["detail"]


async def test_oversized_chunked_body_answers_413() -> None:
    async def chunks():  # no Content-Length: the limit counts the streamed bytes
        for _ in range(10):
            yield b" " * 500

    async with served(small_config(max_body_bytes=1000)) as s:
        r = await s.client.post(
            "/v1/lookup", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
