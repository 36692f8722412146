"""bench.ttft's tiny configuration on the CPU backend: every restore path gives back the
stored KV bit for bit and the GPU hit's greedy tokens. Timings are reported, not asserted."""

from __future__ import annotations

import argparse
import asyncio
import shutil

import pytest

pytest.importorskip("transformers")

from bench import ttft


def test_tiny_ttft_restores_every_byte_and_the_same_tokens(capsys) -> None:
    paths = "recompute,gpu_hit,restore,layerwise,disk" + (
        ",redis" if shutil.which("redis-server") else ""
    )
    args = argparse.Namespace(
        tiny=True, contexts="48,80", turn=16, decode=6, reps=1, mechanisms="auto", paths=paths
    )
    result = asyncio.run(ttft._run(args))
    rows = {(r["context"], r["path"]): r for r in result["rows"]}
    for context in (48, 80):
        for path in (
            "restore (auto)",
            "layerwise",
            "disk",
            *(("redis",) if "redis" in paths else ()),
        ):
            row = rows[(context, path)]
            assert row["kv_equal"] is True, (context, path)
            assert row["tokens_equal"] is True, (context, path)
            assert row["logits_equal"] is True, (context, path)
        assert rows[(context, "disk")]["tier_promoted_blocks"] > 0
        assert rows[(context, "recompute")]["tokens"].endswith("/6")
    print(ttft._table(result["rows"]))
    assert "layerwise" in capsys.readouterr().out


def test_tiny_concurrent_returns_restore_every_byte_and_the_gpu_hits_logits() -> None:
    n = 8
    args = argparse.Namespace(
        tiny=True, contexts="none", turn=16, decode=4, reps=1, mechanisms="auto",
        paths="recompute,restore,layerwise", concurrent=n, seed=0, max_context=256,
    )  # fmt: skip
    section = asyncio.run(ttft._run(args))["concurrent"]
    convs = section["conversations"]
    resident = [c for c in convs if c["resident"]]
    # the GPU cache holds a quarter of the KV (or the largest context): most must come back
    assert section["capacity_blocks"] * 4 >= section["total_blocks"]
    assert 0 < len(resident) < n
    block_bytes = section["kv_bytes"] // section["total_blocks"]
    miss_blocks = sum(-(-c["context"] // 16) for c in convs if not c["resident"])
    rows = {r["path"]: r for r in section["rows"]}
    for path in ("restore (auto)", "layerwise"):
        row = rows[path]
        assert row["loaded_bytes"] == row["restore_bytes"] == miss_blocks * block_bytes
        assert row["kv_equal"] == row["kv_checked"] == n, path
        assert row["logits_equal"] == n, path
        assert row["tokens_equal"] == row["checked"] == n, path
        assert row["saved_tokens"] == sum(c["context"] for c in convs)
        assert len(row["ttfts_ms"]) == n
    recompute = rows["recompute"]
    assert recompute["loaded_bytes"] == 0
    assert recompute["saved_tokens"] == sum(c["context"] for c in resident)
    assert recompute["kv_equal"] == recompute["kv_checked"] == len(resident)
    assert ttft._concurrent_failures(section) == []
    assert "layerwise" in ttft._concurrent_table(section)
