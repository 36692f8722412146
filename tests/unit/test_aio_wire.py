"""The wire form of the engine's results: one definition, written fast, read back exactly."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvcache_offload.aio.types import (
    EngineStats,
    Histogram,
    KeyState,
    LoadLease,
    LookupResult,
    StoreLease,
    StoreResult,
)
from kvcache_offload.aio.wire import WireError, _adapter, from_wire, to_wire
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.kv_events.stats import KVEventStats
from kvcache_offload.tiers.base import TierStats

A, B = OffloadKey(b"\x01" * 8 + b"\0\0\0\0"), OffloadKey(b"\x02" * 8 + b"\0\0\0\1")

SAMPLES: list[Any] = [
    LookupResult(1, True, [KeyState.READY, KeyState.WRITING], ["CPU", None], [A, B]),
    LookupResult(0, False, [KeyState.ABSENT]),
    StoreLease("s1", [A], [7], [B], 12.5),
    LoadLease("l1", [A, B], [1, 2], 3.0),
    StoreResult([A], [], 8192, 0.25),
    EngineStats(
        "lru", 8, 4, 1, 2, 1,
        transfer_duration={"gpu_to_cpu": Histogram()},
        mrc_hit_ratio={0.5: 0.25, 2.0: 0.75},
        kv_events=KVEventStats(1, 2, 3, 4, 5),
        tiers=[TierStats("disk", "disk", blocks=3)],
    ),
]  # fmt: skip


@pytest.mark.parametrize("value", SAMPLES, ids=lambda v: type(v).__name__)
def test_the_fast_writer_gives_exactly_the_schemas_json(value: Any) -> None:
    fast = json.loads(json.dumps(to_wire(value)))
    assert fast == _adapter(type(value)).dump_python(value, mode="json")


@pytest.mark.parametrize("value", SAMPLES, ids=lambda v: type(v).__name__)
def test_what_the_server_writes_the_client_reads_back_unchanged(value: Any) -> None:
    assert from_wire(type(value), json.loads(json.dumps(to_wire(value)))) == value


def test_keys_travel_as_hex_and_absent_optionals_can_be_left_out() -> None:
    out = to_wire(LookupResult(0, False, [KeyState.ABSENT]), exclude_none=True)
    assert out == {"hits": 0, "pending": False, "states": ["absent"]}
    assert to_wire(StoreLease("s", [A], [1], [], 1.0))["keys_to_store"] == [A.hex()]


def test_an_answer_of_the_wrong_shape_is_a_wire_error() -> None:
    with pytest.raises(WireError, match="not a StoreLease"):
        from_wire(StoreLease, {"lease_id": "x", "keys_to_store": ["zz"]})
