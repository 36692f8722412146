"""bench.serving computes its serving goals from its own rows, and runs end to end on the CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench._serving_goals import check_goals


def _single(direction: str, blocks: int, p50_us: float, floor_us: float, p99_us: float) -> dict:
    return {"direction": direction, "blocks": blocks, "mechanism": "auto", "p50_s": p50_us * 1e-6,
            "p99_s": p99_us * 1e-6, "floor_p50_s": floor_us * 1e-6,
            "ratio_p50": p50_us / floor_us}  # fmt: skip


def _stream(name: str, share: float, p99_ms: float, bound_ms: float, cores: float) -> dict:
    return {"stream": name, "mechanism": "auto", "ratio_to_one_way_bulk": share,
            "p99_s": p99_ms * 1e-3, "p99_bound_s": bound_ms * 1e-3, "cpu_cores": cores}  # fmt: skip


def test_goals_follow_the_issue_thresholds_on_cuda() -> None:
    single = [
        _single("load", 1, 100, 61, 150),  # +39 us: met
        _single("store", 1, 110, 60, 400),  # +50 us, and a tail over 1.5 x p50 + 100 us
        _single("load", 8, 370, 330, 400),  # 1.12x: met
        _single("load", 64, 2900, 2450, 3000),  # 1.18x: not met
    ]
    streams = [
        {
            **_stream("loads 4-block", 0.98, 5.0, 9.7, 1.1),
            "thread_cores": {"loop": 0.97, "native": 0.13},
        },
        _stream("stores 4-block", 0.89, 5.0, 9.7, 0.9),
        _stream("mixed 4-block", 1.61, 6.0, 5.5, 1.0),
        _stream("loads 1-block", 0.80, 1.0, 2.4, 1.0),
    ]
    other_column = [{**_stream("loads 4-block", 0.1, 1, 1, 1), "mechanism": "kernel"}]
    goals = {g.goal: (g.value, g.met) for g in check_goals(single, streams + other_column, "cuda")}
    assert goals["1-block load p50 <= floor + 40 us"] == ("+39 us", True)
    assert goals["1-block store p50 <= floor + 40 us"] == ("+50 us", False)
    assert goals["8-block load p50 <= 1.15x floor"] == ("1.12x", True)
    assert goals["64-block load p50 <= 1.15x floor"] == ("1.18x", False)
    assert goals["single-job p99 <= 1.5 x p50 + 100 us"] == ("store 1 over", False)
    assert goals["loads 4-block stream >= 0.9 x one-way bulk"] == ("0.98", True)
    assert goals["stores 4-block stream >= 0.9 x one-way bulk"] == ("0.89", False)
    assert goals["mixed 4-block stream >= 1.6 x one-way bulk"] == ("1.61", True)
    assert goals["loads 1-block stream >= 0.8 x one-way bulk"] == ("0.80", True)
    assert goals["stream p99 <= 2 x bytes in flight / bulk"] == ("mixed 4-block over", False)
    assert goals["a stream costs at most one core"] == (
        "up to 1.10 (loads 4-block, loop thread 0.97)",
        False,
    )


@pytest.mark.parametrize(("cores", "met"), [(1.0008, True), (1.004, True), (1.006, False)])
def test_the_cores_goal_compares_at_the_precision_it_shows(cores: float, met: bool) -> None:
    # A loop-bound stream keeps the loop thread busy throughout: 1.000-1.001 cores for the
    # process is one core as the table shows it; 1.006 shows as 1.01 and is over.
    streams = [_stream("mixed 4-block", 1.7, 1.0, 2.0, cores)]
    goals = {g.goal: (g.value, g.met) for g in check_goals([], streams, "cuda")}
    value, ok = goals["a stream costs at most one core"]
    assert ok is met
    assert value.startswith(f"up to {cores:.2f}")


def test_goals_on_the_cpu_backend_ask_for_0_7_of_a_one_thread_copy() -> None:
    streams = [
        _stream("loads 4-block", 0.95, 1, 2, 0.5),
        _stream("stores 4-block", 0.65, 1, 2, 0.5),
    ]
    (goal,) = check_goals([], streams, "cpu")
    assert (goal.value, goal.met) == ("lowest 0.65 (stores 4-block)", False)
    assert check_goals([], streams, "cpu", column="kernel") == []


def test_bench_serving_runs_on_the_cpu_and_writes_its_goals(tmp_path: Path) -> None:
    from bench.serving import main

    out = tmp_path / "serving.json"
    main(["--device", "cpu", "--reps", "3", "--stream-s", "0.05", "--passes", "2",
          "--mechanisms", "auto,auto+gc_freeze=0", "--warmup-s", "0", "--sweep", "2",
          "--pace-ms", "0.2", "--out", str(out)])  # fmt: skip
    payload: dict[str, Any] = json.loads(out.read_text())
    (layout,) = payload["layouts"]
    # Both columns' engines ran every measurement (interleaved), both passes pooled.
    for column in ("auto", "auto+gc_freeze=0"):
        streams = [s for s in layout["streams"] if s["mechanism"] == column]
        assert len(streams) == 6 and all(len(s["pass_gb_s"]) == 2 for s in streams)
        assert {
            (r["direction"], r["blocks"]) for r in layout["single"] if r["mechanism"] == column
        } == {(d, n) for d in ("load", "store") for n in (1, 8, 64)}
    # The floor took its turn with the engines: every single-job row has one.
    assert all(r["floor_p50_s"] > 0 for r in layout["single"])
    # Each row also says how long the copy itself took, which the wall time includes.
    assert all(0 < r["copy_p50_s"] <= r["p50_s"] for r in layout["single"])
    names = {s["stream"] for s in layout["streams"]}
    assert {"loads 4-block", "mixed 4-block", "loads 2-block", "stores 2-block"} <= names
    assert all(s["reloads"] == 0 and s["jobs"] > 0 for s in layout["streams"])
    # Each stream says how fast the host ran at the time, and what a job cost the process.
    assert all(s["host_probe_s"] > 0 and s["cpu_s_per_job"] > 0 for s in layout["streams"])
    assert all(isinstance(s["paths"], dict) for s in layout["streams"])
    # ... and which threads spent it: the event loop's own share is named.
    assert all(s["thread_cores"].get("loop", -1) >= 0 for s in layout["streams"])
    # Paced 1-block jobs (the loop idle before each, the floor paced alike), every column,
    # both ways, both passes pooled; not among the goals' rows.
    paced = layout["paced"]
    assert {(r["mechanism"], r["direction"]) for r in paced} == {
        (m, d) for m in ("auto", "auto+gc_freeze=0") for d in ("load", "store")
    }
    assert all(r["jobs"] == 3 * 2 and r["pace_s"] == 0.0002 for r in paced)
    assert all(r["floor_p50_s"] > 0 and 0 < r["p50_s"] <= r["p99_s"] for r in paced)
    (goal,) = layout["goals"]
    assert goal["goal"] == "every stream at 0.7 of a one-thread copy"


def test_each_stream_counts_the_paths_its_own_jobs_took() -> None:
    # The engine's counters run over all its streams: a stream's share is the difference
    # around it, per direction, and pooled passes add up.
    from bench.serving import StreamResult, _paths_since, _summed

    before = {"store": {"kernel": 10, "staged": 5}, "load": {"kernel": 3, "staged": 0}}
    after = {"store": {"kernel": 16, "staged": 7}, "load": {"kernel": 3, "staged": 4}}
    paths = _paths_since(before, after)
    assert paths == {"store": {"kernel": 6, "staged": 2}, "load": {"staged": 4}}
    stream = StreamResult("mixed 4-block", 0, 1.0, [], 1.0, 0, paths=paths)
    assert stream.kernel_share("store") == 0.75
    assert stream.kernel_share("load") == 0.0
    pooled = _summed([paths, {"store": {"kernel": 2}}])
    assert pooled == {"store": {"kernel": 8, "staged": 2}, "load": {"staged": 4}}
    assert StreamResult("loads 1-block", 0, 1.0, [], 1.0, 0).kernel_share("store") is None


def test_thread_cpu_names_the_loop_thread_and_adds_up_a_named_threads_time() -> None:
    import threading
    import time

    from bench.serving import thread_cpu

    burned, release = threading.Event(), threading.Event()

    def burn() -> None:
        while time.thread_time() < 0.15:  # this thread's own CPU time, however busy the host
            pass
        burned.set()
        release.wait()  # stay alive: an ended thread's time leaves /proc with it

    assert "loop" in thread_cpu()
    worker = threading.Thread(target=burn, name="busy-worker-8")
    worker.start()
    try:
        assert burned.wait(60)
        during = thread_cpu()
    finally:
        release.set()
        worker.join()
    assert during.get("busy-worker", 0.0) >= 0.1  # digits dropped: a pool adds up


def test_thread_cpu_names_a_thread_not_started_from_python_by_its_kernel_name() -> None:
    from bench.serving import thread_cpu
    from kvcache_offload.dataplane.copy.host_copy import NativeCopyQueue

    if NativeCopyQueue is None:
        pytest.skip("the host-copy extension is not built (no C compiler at install)")
    queue = NativeCopyQueue("native-probe-7", batch_policy=False)  # a pthread named in C
    try:
        names = thread_cpu()
    finally:
        queue.close()
    # Not lumped in with every other native thread: the CUDA driver's own event thread
    # (cuda-EvtHandlr) shows apart from ours in a stream's cores.
    assert "native:native-probe" in names
    assert "loop" in names


def test_each_stream_is_measured_against_the_bulk_of_its_own_direction() -> None:
    # The issue asks for loads and stores "at least 0.90 of bulk one way each": a stores
    # stream against the bulk copy to the CPU, which differs from the one to the GPU.
    from bench.serving import stream_bulk

    to_gpu, to_cpu, both = 55e9, 48e9, 90e9
    assert stream_bulk("loads 4-block", to_gpu, to_cpu, both) == (to_gpu, to_gpu)
    assert stream_bulk("loads 1-block", to_gpu, to_cpu, both) == (to_gpu, to_gpu)
    assert stream_bulk("stores 4-block", to_gpu, to_cpu, both) == (to_cpu, to_cpu)
    assert stream_bulk("stores 16-block", to_gpu, to_cpu, both) == (to_cpu, to_cpu)
    assert stream_bulk("mixed 4-block", to_gpu, to_cpu, both) == (to_gpu, both)
