"""bench.ttft's returning conversations: a request returns when an earlier request already
held its first two or more blocks; its context, new turn and gap come from the trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench._ttft_trace import draw, returning
from kvcache_offload.errors import ConfigError


def _trace(tmp_path: Path, requests: list[tuple[int, int, list[int]]]) -> Path:
    path = tmp_path / "trace.jsonl"
    lines = [
        json.dumps({"timestamp": ts, "input_length": n, "output_length": 8, "hash_ids": ids})
        for ts, n, ids in requests
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_later_turn_returns_with_its_shared_prefix_as_context(tmp_path: Path) -> None:
    path = _trace(
        tmp_path,
        [
            (0, 1500, [1, 2, 3]),  # first turn: two full blocks, a partial third
            (1000, 2100, [1, 7]),  # only a system prompt's block shared: not a return
            (4000, 2100, [1, 2, 3, 4, 5]),  # returns: blocks 1, 2 were a prefix before
            (9000, 3000, [1, 2, 3, 4, 5, 6]),  # returns to the previous turn's 4 full blocks
        ],
    )
    assert returning(path) == [(2, 1024, 1076, 4.0), (3, 2048, 952, 5.0)]


def test_draw_scales_token_counts_for_the_tiny_model_and_caps_them(tmp_path: Path) -> None:
    path = _trace(tmp_path, [(0, 5000, list(range(10))), (2000, 9000, list(range(18)))])
    (conv,) = draw(path, 1, seed=0, tiny=True, max_context=256, max_turn=32)
    assert (conv.index, conv.trace_context, conv.trace_turn, conv.gap_s) == (1, 4608, 4392, 2.0)
    assert (conv.context, conv.turn) == (144, 32)
    (capped,) = draw(path, 1, seed=0, tiny=False, max_context=4096, max_turn=2048)
    assert (capped.context, capped.turn) == (4096, 2048)
    with pytest.raises(ConfigError, match="1 returning conversations, 2 wanted"):
        draw(path, 2, seed=0, tiny=True, max_context=256, max_turn=32)
