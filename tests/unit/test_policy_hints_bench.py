"""research.policy_hints: conversations inferred from key chains, hints that pay on the sample."""

from __future__ import annotations

from kvcache_offload.lab.trace import sample_trace_path
from research.policy_hints import conversations, main
from tests.unit._keys import keys


def test_a_request_continues_the_one_whose_full_blocks_it_extends() -> None:
    system = keys(0)
    first = system + keys(1, 2, 3)  # 3 is a partial last block
    other = system + keys(7, 8)
    second = system + keys(1, 2, 4, 5)  # extends first's full blocks 0, 1, 2
    fork = system + keys(1, 9)  # shares only two blocks with first: not deep enough
    third = system + keys(1, 2, 4, 5, 6)
    conv = conversations([first, other, second, fork, third], min_depth=3)
    assert conv == [0, 1, 0, 3, 0]
    # At depth 1 everything after the system prompt would chain onto the shortest request.
    assert conversations([system + keys(1), system + keys(2, 3)], min_depth=1) == [0, 0]


def test_hints_on_the_shipped_sample_beat_the_same_policy_without_them() -> None:
    out = main(["--trace", str(sample_trace_path()), "--capacities", "5%", "--policies", "lru",
                "--delays-s", "0", "--no-json"])  # fmt: skip
    rows = {row["mode"]: row for row in out["rows"]}
    assert set(rows) == {"discard", "release"}
    for row in rows.values():
        assert row["lru"] == row["none"] < row["0 s"] <= row["belady"]


def test_a_hint_naming_the_whole_last_request_pays_too() -> None:
    # The vLLM plug-in releases every key of the hinted request, shared prefixes included.
    out = main(["--trace", str(sample_trace_path()), "--capacities", "5%", "--policies", "lru",
                "--delays-s", "0", "--modes", "release", "--scope", "request",
                "--no-json"])  # fmt: skip
    (row,) = out["rows"]
    assert row["lru"] == row["none"] < row["0 s"] <= row["belady"]
    assert out["args"]["scope"] == "request"
