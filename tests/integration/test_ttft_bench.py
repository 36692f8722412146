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
