"""vLLM 0.33's scheduler never calls ``touch``; the plug-in replays 0.21's touches from the keys
each request loads or offers to store (``_request_keys``). Replayed over the shipped Mooncake
sample, the policies then decide exactly as under 0.21's calls, which the lab's driver makes
(``research.vllm_touches`` does the same over the full traces)."""

from __future__ import annotations

import pytest

from kvcache_offload.control.manager import CPUOffloadingManager
from kvcache_offload.lab.driver import replay_trace
from kvcache_offload.lab.trace import load_trace, sample_trace_path
from research.vllm_touches import main, replay_as_vllm_033


def _capacity(trace_keys: list[list[bytes]], share: float) -> int:
    return max(8, int(len({k for keys in trace_keys for k in keys}) * share))


@pytest.mark.parametrize("policy", ["lru", "adaptive", "arc"])
@pytest.mark.parametrize("share", [0.02, 0.1])
def test_the_replayed_touches_decide_as_vllm_021s_calls(policy: str, share: float) -> None:
    trace = load_trace(sample_trace_path())
    capacity = _capacity(trace.keys, share)
    expected = replay_trace(CPUOffloadingManager(capacity, policy), trace).block_hits
    got = replay_as_vllm_033(CPUOffloadingManager(capacity, policy), trace, "replayed")
    assert got == expected


def test_without_the_replay_the_default_policy_loses_hits() -> None:
    # What the plug-in did before: no touch at all, or one at each request's end.
    trace = load_trace(sample_trace_path())
    capacity = _capacity(trace.keys, 0.02)
    expected = replay_trace(CPUOffloadingManager(capacity, "adaptive"), trace).block_hits
    for mode in ("none", "at end"):
        manager = CPUOffloadingManager(capacity, "adaptive")
        assert replay_as_vllm_033(manager, trace, mode) < expected


def test_the_benchmark_prints_and_returns_every_mode() -> None:
    out = main(["--trace", str(sample_trace_path()), "--policies", "lru", "--capacities", "5%",
                "--no-json"])  # fmt: skip
    (row,) = out["rows"]
    assert row["replayed"] == row["0.21 calls"]
    assert set(row) >= {"none", "at end", "replayed", "0.21 calls"}
