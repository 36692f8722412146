"""Fixed byte vectors pin the wire encoding; the documented schema decodes it."""

from __future__ import annotations

import struct

import msgspec
import pytest

from kvcache_offload.kv_events import END_SEQ, WireCodec
from tests.unit._kv_subscriber import schema

TS = 1700000000.25
MAX = 2**64 - 1


def s(text: str) -> str:
    """A msgpack fixstr (< 32 bytes) as hex."""
    assert len(text) < 32
    return f"{0xA0 + len(text):02x}" + text.encode().hex()


HASHES = "92" + "01" + "cf" + "ff" * 8  # [1, 2**64 - 1]: a fixint and a uint64
TOKENS = "93010203"  # [1, 2, 3]
BATCH_HEAD = "93" + "cb" + struct.pack(">d", TS).hex() + "93"  # [ts, [3 events], rank]
RANK_0 = "00"

ARRAY_VECTOR = (
    BATCH_HEAD
    # ["BlockStored", hashes, parent=nil, tokens, 16, lora_id=nil, "CPU", lora_name=nil,
    #  extra_keys=nil, group_idx=0]
    + "9a" + s("BlockStored") + HASHES + "c0" + TOKENS + "10" + "c0" + s("CPU") + "c0c0" + "00"
    # ["BlockRemoved", [2**64 - 1], "CPU", group_idx=0]
    + "94" + s("BlockRemoved") + "91cf" + "ff" * 8 + s("CPU") + "00"
    # ["AllBlocksCleared"]
    + "91" + s("AllBlocksCleared")
    + RANK_0
)  # fmt: skip

MAP_VECTOR = (
    BATCH_HEAD
    # 9 entries: extra_keys is left out (None is its default)
    + "89" + s("type") + s("BlockStored") + s("block_hashes") + HASHES
    + s("parent_block_hash") + "c0" + s("token_ids") + TOKENS + s("block_size") + "10"
    + s("lora_id") + "c0" + s("medium") + s("CPU") + s("lora_name") + "c0"
    + s("group_idx") + "00"
    + "84" + s("type") + s("BlockRemoved") + s("block_hashes") + "91cf" + "ff" * 8
    + s("medium") + s("CPU") + s("group_idx") + "00"
    + "81" + s("type") + s("AllBlocksCleared")
    + RANK_0
)  # fmt: skip


def sample_payload(codec: WireCodec) -> bytes:
    return codec.encode_batch(
        [
            codec.stored(
                [1, MAX],
                parent_block_hash=None,
                token_ids=[1, 2, 3],
                block_size=16,
                medium="CPU",
                group_idx=0,
            ),
            codec.removed([MAX], medium="CPU", group_idx=0),
            codec.cleared(),
        ],
        ts=TS,
    )


@pytest.mark.parametrize(("encoding", "vector"), [("array", ARRAY_VECTOR), ("map", MAP_VECTOR)])
def test_a_batch_encodes_to_the_pinned_bytes(encoding: str, vector: str) -> None:
    assert sample_payload(WireCodec(encoding)).hex() == vector  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_the_documented_schema_decodes_every_event_type(encoding: str) -> None:
    batch = msgspec.msgpack.decode(
        sample_payload(WireCodec(encoding)),  # type: ignore[arg-type]
        type=schema(encoding == "array"),
    )
    stored, removed, cleared = batch.events
    assert (batch.ts, batch.data_parallel_rank) == (TS, 0)
    assert type(stored).__name__ == "BlockStored"
    assert (stored.block_hashes, stored.token_ids, stored.block_size) == ([1, MAX], [1, 2, 3], 16)
    assert (stored.parent_block_hash, stored.medium, stored.group_idx) == (None, "CPU", 0)
    assert type(removed).__name__ == "BlockRemoved"
    assert (removed.block_hashes, removed.medium, removed.group_idx) == ([MAX], "CPU", 0)
    assert type(cleared).__name__ == "AllBlocksCleared"


def test_the_two_encodings_are_not_interchangeable() -> None:
    """Why the encoding is a setting: msgspec decoders accept only the shape they declare."""
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(sample_payload(WireCodec("map")), type=schema(True))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(sample_payload(WireCodec("array")), type=schema(False))


def test_bytes_hashes_are_msgpack_bin() -> None:
    codec = WireCodec("array")
    payload = codec.encode_batch([codec.removed([b"\xab" * 32], medium="CPU", group_idx=0)], ts=TS)
    assert ("c420" + "ab" * 32) in payload.hex()  # bin 8 of 32 bytes


def test_the_replay_end_marker_is_minus_one_as_8_signed_big_endian_bytes() -> None:
    assert END_SEQ == b"\xff" * 8
