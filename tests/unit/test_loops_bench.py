"""bench.loops: both loops measured in one process, and the summary it prints."""

from __future__ import annotations

import pytest

from bench.loops import available_loops, main, summary


def test_each_round_runs_every_loop_and_the_summary_counts_rounds_uvloop_won() -> None:
    rounds = {
        "asyncio": [{"single load 1 +us": 40.0, "loads 1 share": 0.5},
                    {"single load 1 +us": 30.0, "loads 1 share": 0.7}],
        "uvloop": [{"single load 1 +us": 35.0, "loads 1 share": 0.6},
                   {"single load 1 +us": 33.0, "loads 1 share": 0.6}],
    }  # fmt: skip
    rows = {r["metric"]: r for r in summary({"layout": "x", "rounds": rounds})}
    # Lower is better for added microseconds, higher for a share of the link.
    assert rows["single load 1 +us"]["uvloop ahead"] == 1
    assert rows["loads 1 share"]["uvloop ahead"] == 1
    assert rows["single load 1 +us"]["asyncio"] == pytest.approx(35.0)  # median of rounds
    assert rows["loads 1 share"]["uvloop"] == pytest.approx(0.6)


def test_bench_loops_runs_both_loops_on_the_cpu_backend() -> None:
    pytest.importorskip("uvloop")
    out = main(["--device", "cpu", "--rounds", "2", "--reps", "3", "--stream-s", "0.05",
                "--warmup-s", "0.02", "--no-json"])  # fmt: skip
    (layout,) = out["layouts"]
    assert available_loops() == ["asyncio", "uvloop"]
    assert {loop: len(r) for loop, r in layout["rounds"].items()} == {"asyncio": 2, "uvloop": 2}
    metrics = {row["metric"] for row in layout["summary"]}
    assert {"single load 1 +us", "mixed 4 share", "loads 1 CPU us/job"} <= metrics
    for runs in layout["rounds"].values():
        assert all(r["loads 1 jobs/s"] > 0 and r["mixed 4 jobs/s"] > 0 for r in runs)
