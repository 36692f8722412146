"""asyncio against uvloop in one process: what an embedding server's choice of loop costs.

    python -m bench.loops [--device auto|cuda|cpu] [--layouts llama8b,tp4_70b,cross_layer]
                          [--rounds 4] [--stream-s 0.8] [--reps 60] [--tasks 32]

The streams that ``bench.serving`` finds bound by the event-loop thread (a mixed 4-block
stream, 1-block loads) and the 1-block single jobs, under each loop in turn: every round
builds one engine with the default configuration per loop (``asyncio.run`` or
``uvloop.run``: an engine belongs to the loop that started it), alternating which loop goes
first, with the single-job floor timed in the same round. A separate run per loop compared
mostly the host: on the lent H200 VMs its speed drifts over seconds by more than the two
loops differ (docs/transfers.md, "How to measure a change"). Prints medians over the rounds, the
ratio uvloop/asyncio and in how many rounds uvloop was ahead; writes JSON under
``bench/out/``. Without uvloop installed the uvloop column is left out (nothing to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench._common import write_json
from bench.serving import (
    LAYOUTS,
    Floors,
    Layout,
    MiB,
    Rig,
    StreamResult,
    device_and_layouts,
    floors_max,
    pct,
    single_jobs,
    stream,
)

STREAMS = (("mixed 4", 4, 0.5), ("loads 1", 1, 1.0))
"""Name, blocks per job, share of the tasks that load (the others store)."""


def _runner(loop: str) -> Callable[[Coroutine[Any, Any, dict[str, float]]], dict[str, float]]:
    if loop == "uvloop":
        import uvloop

        return uvloop.run
    return asyncio.run


def _stream_row(prefix: str, result: StreamResult, bulk: float) -> dict[str, float]:
    jobs = max(1, len(result.job_times))
    return {
        f"{prefix} share": result.rate / bulk,
        f"{prefix} jobs/s": jobs / result.seconds,
        f"{prefix} CPU us/job": result.cpu_s_per_job * 1e6,
        f"{prefix} loop cores": result.thread_cores.get("loop", float("nan")),
        f"{prefix} p99 ms": pct(result.job_times, 99) * 1e3,
    }


async def one_round(
    layout: Layout, device: str, floors: Floors, bulk: float, args: argparse.Namespace
) -> dict[str, float]:
    """One engine on the running loop: 1-block single jobs over their floor, then the
    streams (after a throwaway one), as shares of ``bulk``."""
    rig = Rig(layout, device, "auto", args.tasks * 4)
    out: dict[str, float] = {}
    async with rig.engine:
        await stream(rig, "warm-up", args.tasks, 4, args.tasks // 2, args.warmup_s)
        loads, stores = await single_jobs(rig, 1, args.reps)
        for name, times in (("load", loads), ("store", stores)):
            floor = floors.job(rig.block_bytes, name == "load", args.reps)
            out[f"single {name} 1 +us"] = (pct(times, 50) - pct(floor, 50)) * 1e6
        for name, blocks, load_share in STREAMS:
            loaders = int(args.tasks * load_share)
            result = await stream(rig, name, args.tasks, blocks, loaders, args.stream_s)
            out.update(_stream_row(name, result, bulk))
    del rig
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_layout(
    layout: Layout, device: str, floors: Floors, loops: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """``args.rounds`` rounds, each running every loop once, the order reversed every round."""
    if device == "cuda":
        bulk = floors.bulk(min(1024 * MiB, floors_max(floors)))
    else:
        block_bytes = Rig(layout, device, "auto", 4).block_bytes
        bulk = floors.host_stream_rate(4 * block_bytes, args.tasks)
    rounds: dict[str, list[dict[str, float]]] = {loop: [] for loop in loops}
    for index in range(args.rounds):
        order = loops if index % 2 == 0 else loops[::-1]
        for loop in order:
            started = time.perf_counter()
            rounds[loop].append(_runner(loop)(one_round(layout, device, floors, bulk, args)))
            print(f"{layout.name} round {index + 1} {loop}: {time.perf_counter() - started:.1f} s")
    return {"layout": layout.name, "bulk_one_way": bulk, "rounds": rounds}


_LOWER_IS_BETTER = ("+us", "CPU us/job", "loop cores", "p99 ms")


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per metric: each loop's median over the rounds, and how often uvloop was ahead."""
    rounds = result["rounds"]
    loops = list(rounds)
    rows = []
    for metric in rounds[loops[0]][0]:
        row: dict[str, Any] = {"metric": metric}
        for loop in loops:
            row[loop] = statistics.median(r[metric] for r in rounds[loop])
        if len(loops) == 2:
            lower = metric.endswith(_LOWER_IS_BETTER)
            pairs = zip(rounds["asyncio"], rounds["uvloop"], strict=True)
            row["uvloop ahead"] = sum(
                (u[metric] < a[metric]) if lower else (u[metric] > a[metric]) for a, u in pairs
            )
        rows.append(row)
    return rows


def report(result: dict[str, Any], rows: list[dict[str, Any]], rounds: int) -> None:
    loops = list(result["rounds"])
    table = Table(
        title=f"{result['layout']}: medians of {rounds} rounds "
        f"(one-way bulk {result['bulk_one_way'] / 1e9:.1f} GB/s)"
    )
    table.add_column("metric")
    for loop in loops:
        table.add_column(loop, justify="right")
    if len(loops) == 2:
        table.add_column("uvloop / asyncio", justify="right")
        table.add_column("uvloop ahead", justify="right")
    for row in rows:
        cells = [f"{row[loop]:.3g}" for loop in loops]
        if len(loops) == 2:
            ratio = row["uvloop"] / row["asyncio"] if row["asyncio"] else float("nan")
            cells += [f"{ratio:.2f}", f"{row['uvloop ahead']}/{rounds}"]
        table.add_row(row["metric"], *cells)
    Console().print(table)


def available_loops() -> list[str]:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return ["asyncio"]
    return ["asyncio", "uvloop"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.loops", description=__doc__)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--layouts", default="")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--stream-s", type=float, default=0.8)
    parser.add_argument("--warmup-s", type=float, default=0.3)
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--no-json", action="store_true", help="do not write bench/out/*.json")
    args = parser.parse_args(argv)
    device, names = device_and_layouts(args.device, args.layouts)
    floors = Floors(device, 1024 * MiB if device == "cuda" else 256 * MiB)
    loops = available_loops()
    layouts = []
    for name in names:
        result = bench_layout(LAYOUTS[name], device, floors, loops, args)
        rows = summary(result)
        report(result, rows, args.rounds)
        layouts.append({**result, "summary": rows})
    out = {"device": device, "args": vars(args), "layouts": layouts}
    if not args.no_json:
        write_json("loops", out)
    return out


if __name__ == "__main__":
    main()
