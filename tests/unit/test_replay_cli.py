"""``kvcache-offload replay`` on the shipped sample writes a table, JSON and a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from kvcache_offload.lab.cli import replay
from kvcache_offload.lab.synth import write_synth_trace
from kvcache_offload.lab.trace import sample_trace_path


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(replay)
    return app


def test_replay_on_the_shipped_sample_writes_json_and_png(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    result = CliRunner().invoke(
        _app(),
        [
            str(sample_trace_path()),
            "--policy",
            "lru,arc",
            "--capacity",
            "1%,5%",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "Belady" in result.output
    data = json.loads(out_json.read_text())
    assert data["traces"][0]["requests"] == 2000
    rows = data["results"]
    assert {(r["policy"], r["capacity"]) for r in rows} == {
        (p, c) for p in ("lru", "arc") for c in ("1%", "5%")
    }
    for row in rows:
        assert 0 <= row["block_hit_rate"] <= row["belady_block_hit_rate"] <= 1
        assert row["gap_to_belady"] >= 0
        assert row["capacity_blocks"] == round(38_788 * row["capacity_percent"] / 100)
    assert len(data["best_policy"]) == 2
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_of_several_traces_with_block_capacities(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_synth_trace(a, num_requests=200, seed=1)
    write_synth_trace(b, num_requests=150, seed=2)
    out_json = tmp_path / "r.json"
    result = CliRunner().invoke(
        _app(),
        [str(a), str(b), "-p", "lru", "-c", "50,200", "--no-belady", "--json", str(out_json)],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(out_json.read_text())["results"]
    assert [(r["trace"], r["capacity_blocks"]) for r in rows] == [
        ("a.jsonl", 50),
        ("a.jsonl", 200),
        ("b.jsonl", 50),
        ("b.jsonl", 200),
    ]
    assert all("belady_block_hit_rate" not in r for r in rows)


def test_replay_reports_bad_input_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "hash_ids": [1]}\n{oops\n')
    result = CliRunner().invoke(_app(), [str(bad), "-p", "lru"])
    assert result.exit_code == 2
    assert "bad.jsonl:2" in result.output
    result = CliRunner().invoke(_app(), [str(bad), "-p", "nope"])
    assert result.exit_code == 2
    assert "nope" in result.output
    result = CliRunner().invoke(_app(), [str(bad), "-p", "lru", "-c", "5 pct"])
    assert result.exit_code == 2


def test_policy_plus_reuse_suffix_wraps_the_reuse_filter(tmp_path: Path) -> None:
    from kvcache_offload.control.reuse_filter import FilterReusedOffloadingManager
    from kvcache_offload.lab.sweep import (
        make_manager,
        split_policy,
    )

    assert split_policy("lru") == ("lru", None)
    assert split_policy("arc+reuse3") == ("arc", 3)
    manager = make_manager("arc+reuse3", 10)
    assert isinstance(manager, FilterReusedOffloadingManager)
    assert manager.store_threshold == 3
    out_json = tmp_path / "r.json"
    result = CliRunner().invoke(
        _app(),
        [str(sample_trace_path()), "-p", "lru,lru+reuse2", "-c", "2%", "--json", str(out_json)],
    )
    assert result.exit_code == 0, result.output
    rows = {r["policy"]: r for r in json.loads(out_json.read_text())["results"]}
    assert rows["lru+reuse2"]["stored_blocks"] < rows["lru"]["stored_blocks"]
    bad = CliRunner().invoke(_app(), [str(sample_trace_path()), "-p", "lru+reusex"])
    assert bad.exit_code == 2


def test_replay_reads_a_log_written_by_the_recorder(tmp_path: Path) -> None:
    from kvcache_offload import make_offload_key
    from kvcache_offload.lab.recorder import RequestRecorder

    keys = [make_offload_key(f"blk{i}".encode(), 0) for i in range(6)]
    log = tmp_path / "rec.jsonl"
    recorder = RequestRecorder(log)
    for round_ in range(3):
        recorder.on_lookup(keys[:4], 0 if round_ == 0 else 4)
        recorder.on_store(keys[:4])
        recorder.on_lookup(keys[:2] + keys[4:], 2 if round_ == 0 else 4)
        recorder.on_store(keys[4:])
    recorder.close()
    out_json = tmp_path / "r.json"
    result = CliRunner().invoke(
        _app(), [str(log), "-p", "lru", "-c", "100", "--json", str(out_json)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out_json.read_text())
    assert data["traces"][0]["requests"] == 6  # each store merged into its lookup
    assert data["traces"][0]["unique_blocks"] == 6
    row = data["results"][0]
    # Request 1 misses all 4, request 2 hits its 2-block prefix; then everything hits.
    assert row["block_hits"] == 2 + 4 * 4
    assert row["belady_block_hits"] == row["block_hits"]
    # What the recording service saw, for comparison with the replay.
    assert data["traces"][0]["observed_block_hits"] == row["block_hits"]
    assert "the recording service saw" in result.output


def test_replay_path_imports_neither_torch_nor_matplotlib() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from kvcache_offload.lab.cli import replay\n"
        "from kvcache_offload.lab import load_trace, run_sweep, parse_capacities\n"
        "from kvcache_offload.lab.trace import sample_trace_path\n"
        "run_sweep([load_trace(sample_trace_path())], ['lru'], parse_capacities('1%'))\n"
        "print('torch' in sys.modules, 'matplotlib' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_unwritable_output_paths_fail_in_one_line_before_the_replay(tmp_path: Path) -> None:
    for flag in ("--plot", "--json"):
        result = CliRunner().invoke(
            _app(), [str(sample_trace_path()), "-p", "lru", flag, "/nonexistent/x.out"]
        )
        assert result.exit_code == 2, result.output
        assert "directory /nonexistent does not exist" in result.output
        assert "Traceback" not in result.output
        assert "replays in" not in result.output  # refused before replaying anything
    result = CliRunner().invoke(_app(), [str(sample_trace_path()), "--plot", str(tmp_path)])
    assert result.exit_code == 2 and "is a directory" in result.output


def test_replay_help_names_no_path_users_do_not_have() -> None:
    result = CliRunner().invoke(_app(), ["--help"])
    assert result.exit_code == 0 and "../shared" not in result.output
