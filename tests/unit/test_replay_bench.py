"""The replay benchmarks run end to end on the shipped sample (smoke tests, no timings)."""

from __future__ import annotations

from pathlib import Path

from kvcache_offload.lab.trace import sample_trace_path


def test_bench_manager_runs_on_the_sample_with_the_classic_baseline() -> None:
    from bench.manager import main

    payload = main(
        ["--trace", str(sample_trace_path()), "--repeat", "2", "--capacities", "5%", "--no-json"]
    )
    rows = {r["policy"]: r for r in payload["results"]}
    assert set(rows) == {"lru", "arc"}
    # Every repetition of each row ran (round-robin), and each rate is set against LRU's.
    assert all(len(r["manager_time_s_all"]) == 2 for r in rows.values())
    assert rows["lru"]["vs_lru"] == 1.0 and rows["arc"]["vs_lru"] > 0
    # Same semantics as the classic manager wherever ARC's #55461 fix does not apply.
    assert rows["lru"]["block_hits"] == rows["lru"]["classic"]["block_hits"]
    assert rows["lru"]["evictions"] == rows["lru"]["classic"]["evictions"]
    assert rows["lru"]["speedup_vs_classic"] > 0


def test_bench_replay_writes_the_docs_section_and_plot(tmp_path: Path) -> None:
    from bench.replay import END, START, main

    doc = tmp_path / "policy-lab.md"
    doc.write_text(f"# intro\n{START}\nold\n{END}\ntrailer\n")
    payload = main(
        [
            "--traces",
            str(sample_trace_path()),
            "--policies",
            "lru,arc",
            "--capacities",
            "2%",
            "--docs",
            str(tmp_path),
            "--no-json",
        ]
    )
    text = doc.read_text()
    assert text.startswith("# intro\n") and text.endswith("trailer\n")
    assert "old" not in text and "| conversation_sample | 2% |" in text
    assert (tmp_path / "policy-lab-hit-rates.png").read_bytes()[:4] == b"\x89PNG"
    assert payload["timing"]["goal_met"] in (True, False)
