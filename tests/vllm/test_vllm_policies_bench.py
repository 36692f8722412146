"""Under vLLM 0.33's manager calls, our LRU keeps what vLLM's own LRU keeps (the plug-in's
replay of touches), on the shipped Mooncake sample; ``research.vllm_policies`` runs."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.vllm._engine import HANDLERS_API

pytestmark = pytest.mark.skipif(HANDLERS_API, reason="vLLM 0.21's manager has the 0.21 calls")


@pytest.mark.parametrize("share", [0.02, 0.1])
def test_our_lru_hits_what_vllm_033s_own_lru_hits(share: float) -> None:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager

    from kvcache_offload.control.manager import CPUOffloadingManager
    from kvcache_offload.lab.trace import load_trace, sample_trace_path
    from research.vllm_policies import replay_ours, replay_vllm

    trace = load_trace(sample_trace_path())
    capacity = max(8, int(len({k for keys in trace.keys for k in keys}) * share))
    theirs = replay_vllm(VllmManager(capacity, cache_policy="lru"), trace)
    assert replay_ours(CPUOffloadingManager(capacity, "lru"), trace) == theirs > 0


def test_the_benchmark_prints_every_column() -> None:
    from kvcache_offload.lab.trace import sample_trace_path
    from research.vllm_policies import main

    out = main(["--trace", str(sample_trace_path()), "--capacities", "5%", "--no-json"])
    (row,) = out["rows"]
    assert set(row) >= {"vLLM lru", "vLLM arc", "ours lru", "ours adaptive"}
    assert row["ours lru"] == row["vLLM lru"]
