"""Policy lab with tiers: hits are attributed to the tier that served them, writes per mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcache_offload.lab.tiered import (
    main,
    replay_tiered,
)
from kvcache_offload.lab.trace import (
    TraceRequest,
    trace_from_requests,
)
from tests.unit._keys import keys

SAMPLE = (
    Path(__file__).resolve().parents[2] / "kvcache_offload/data/mooncake_conversation_sample.jsonl"
)


def trace(*requests: list[int]):  # type: ignore[no-untyped-def]
    return trace_from_requests(
        TraceRequest(float(i), 16 * len(r), 1, keys(*r)) for i, r in enumerate(requests)
    )


def test_a_block_evicted_from_the_cpu_tier_is_a_hit_in_the_tier_below() -> None:
    t = trace([1, 2], [3, 4], [1, 2, 5])
    through = replay_tiered(t, cpu_blocks=2, tier_blocks=[10], write_mode="through")
    assert through.hits == {"CPU": 0, "tier1": 2}
    assert through.writes == {"tier1": 5}  # every stored block, once
    back = replay_tiered(t, cpu_blocks=2, tier_blocks=[10], write_mode="back")
    assert back.hits == {"CPU": 0, "tier1": 2}
    # 1, 2 (evicted by 3, 4), then 3, 4 (evicted by promoting 1, 2); the block 5 then evicts
    # came up from the tier unchanged, so it is not written again.
    assert back.writes == {"tier1": 4}
    assert back.promoted == through.promoted == 2


def test_the_prefix_stops_at_the_first_block_held_nowhere() -> None:
    t = trace([1, 2, 3], [4, 5, 6], [1, 9, 3])
    counts = replay_tiered(t, cpu_blocks=3, tier_blocks=[10])
    assert counts.hits == {"CPU": 0, "tier1": 1}  # key 3 is below, but key 9 is nowhere


def test_the_cli_compares_both_write_modes_on_a_trace() -> None:
    results = main([str(SAMPLE), "--cpu", "5%", "--tiers", "10%", "--names", "disk"])
    assert [r.write_mode for r in results] == ["through", "back"]
    for r in results:
        assert 0 < r.hit_rate() <= 1
        assert r.hit_rate("CPU") + r.hit_rate("disk") == pytest.approx(r.hit_rate())
