"""bench.ab: which tree is ahead in each round, the run order, and a real run on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import ab


def _report(over_floor_us: float, share: float, probe_us: float) -> dict[str, Any]:
    floor = 50e-6
    return {
        "single": [{"direction": "load", "blocks": 1, "p50_s": floor + over_floor_us * 1e-6,
                    "floor_p50_s": floor, "ratio_p50": 1 + over_floor_us * 1e-6 / floor}],
        "streams": [{"stream": "mixed 4-block", "ratio_to_one_way_bulk": share,
                     "cpu_s_per_job": 60e-6, "p99_s": 1e-3, "p99_bound_s": 2e-3,
                     "host_probe_s": probe_us * 1e-6}],
    }  # fmt: skip


def test_each_measure_counts_the_rounds_the_new_tree_did_better_in_its_own_direction() -> None:
    runs = {
        ("base", "tp4_70b", 1): _report(30, 1.50, 300),
        ("new", "tp4_70b", 1): _report(25, 1.60, 200),  # ahead on both
        ("base", "tp4_70b", 2): _report(30, 1.50, 300),
        ("new", "tp4_70b", 2): _report(35, 1.40, 400),  # behind on both
        ("base", "tp4_70b", 3): _report(30, 1.50, 300),
        ("new", "tp4_70b", 3): _report(20, 1.55, 300),  # ahead on both
        ("new", "tp4_70b", 4): _report(0, 9.0, 1),  # no base in round 4: left out
    }
    rows = {(r.measure, r.unit): r for r in ab.summarize(runs)}
    over = rows[("load 1", "us over floor")]
    assert over.new_ahead == 2 and over.rounds == 3
    assert over.base == pytest.approx(30) and over.new == pytest.approx(25)
    share = rows[("mixed 4-block", "share of link")]
    assert share.new_ahead == 2 and share.new == pytest.approx(1.55)
    assert share.per_round == [(1.50, 1.60), (1.50, 1.40), (1.50, 1.55)]
    assert rows[("mixed 4-block", "p99 / bound")].new_ahead == 0  # equal is not ahead
    assert rows[("mixed 4-block", "host probe us")].new_ahead is None  # the host, not the code


def test_paced_jobs_are_scored_over_their_own_paced_floor() -> None:
    def report(p50_us: float) -> dict[str, Any]:
        paced = [{"direction": "store", "blocks": 1, "p50_s": p50_us * 1e-6,
                  "floor_p50_s": 100e-6}]  # fmt: skip
        return {**_report(30, 1.5, 300), "paced": paced}

    runs = {("base", "llama8b", 1): report(180), ("new", "llama8b", 1): report(150)}
    row = {(r.measure, r.unit): r for r in ab.summarize(runs)}[("store 1 paced", "us over floor")]
    assert (row.base, row.new, row.new_ahead) == (pytest.approx(80), pytest.approx(50), 1)
    # A base whose bench.serving had no paced rows: those are left out, the rest scored.
    mixed = {("base", "x", 1): _report(30, 1.5, 300), ("new", "x", 1): report(150)}
    measures = {r.measure for r in ab.summarize(mixed)}
    assert "load 1" in measures and "store 1 paced" not in measures


def test_every_round_runs_both_trees_on_every_layout_with_both_orders_alternating() -> None:
    order = ab.schedule(2, ["a", "b"])
    assert order == [
        (1, "a", "base"), (1, "a", "new"), (1, "b", "base"), (1, "b", "new"),
        (2, "b", "new"), (2, "b", "base"), (2, "a", "new"), (2, "a", "base"),
    ]  # fmt: skip


def test_a_base_that_is_not_a_revision_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ab.ABError, match="no-such-revision"):
        ab.make_base("no-such-revision", tmp_path)


def test_a_base_without_the_library_is_a_clear_error(tmp_path: Path) -> None:
    empty_tree = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"  # git's empty tree
    who = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    commit = subprocess.run(
        ["git", "commit-tree", empty_tree, "-m", "empty"],
        cwd=ab.ROOT, capture_output=True, text=True, env={**os.environ, **who},
    )  # fmt: skip
    if commit.returncode:
        pytest.skip("not a git checkout")
    with pytest.raises(ab.ABError, match="no kvcache_offload package"):
        ab.make_base(commit.stdout.strip(), tmp_path)


@pytest.mark.skipif(
    subprocess.run(["git", "rev-parse", "HEAD"], cwd=ab.ROOT, capture_output=True).returncode,
    reason="not a git checkout",
)
def test_it_compares_this_tree_with_head_end_to_end_on_the_cpu() -> None:
    pytest.importorskip("torch")
    before = set(ab.ROOT.glob("bench/out/ab-*.json"))
    done = subprocess.run(
        [sys.executable, "-m", "bench.ab", "--base", "HEAD", "--rounds", "1", "--layouts",
         "cpu_small", "--", "--device", "cpu", "--reps", "3", "--stream-s", "0.05",
         "--warmup-s", "0", "--tasks", "4"],
        cwd=ab.ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (written,) = set(ab.ROOT.glob("bench/out/ab-*.json")) - before
    data = json.loads(written.read_text())
    written.unlink()
    units = {(r["measure"], r["unit"]) for r in data["rows"]}
    assert ("load 1", "us over floor") in units and ("loads 1-block", "share of link") in units
    assert all(r["rounds"] == 1 for r in data["rows"])
    assert data["base"] == "HEAD" and data["layouts"] == ["cpu_small"]
