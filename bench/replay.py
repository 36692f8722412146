"""Policy lab on the shipped Mooncake traces: every policy against Belady.

    python -m bench.replay [--traces PATH ...] [--policies all] [--capacities 1%,2%,5%,10%,20%]
                           [--docs docs]

Replays each trace through the real ``CPUOffloadingManager`` for every registered policy at
each capacity (percent of the trace's unique blocks), computes the Belady (MIN with bypass)
bound for the same capacity, and reports hit rates, the gap to Belady and the best policy per
point. It also times one replay of the conversation trace at 10 % end to end for every
policy (goal: under 3 s). Writes ``bench/out/replay-*.json`` and, with ``--docs``, the plot
``<docs>/policy-lab-hit-rates.png`` and the table between the bench markers of
``<docs>/policy-lab.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench._common import machine_info, write_json
from kvcache_offload.config import OffloadConfig
from kvcache_offload.control.policies.registry import available_cache_policies
from kvcache_offload.lab.cli import plot_result
from kvcache_offload.lab.driver import replay_trace
from kvcache_offload.lab.sweep import (
    SweepResult,
    make_manager,
    parse_capacities,
    run_sweep,
)
from kvcache_offload.lab.trace import (
    Trace,
    default_trace_paths,
    load_trace,
)

DEFAULT_POLICY = OffloadConfig.model_fields["eviction_policy"].default
"""The service's default policy: its column and curve say so."""
TIMED_CAPACITY = "10%"
TIME_GOAL_S = 3.0


def _short(name: str) -> str:
    return name.removesuffix(".jsonl").removesuffix("_trace").removeprefix("mooncake_")


def _rows(result: SweepResult, policies: list[str]) -> list[dict[str, Any]]:
    """One row per (trace, capacity): every policy's hit rate, Belady, best and its gap."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for p in result.points:
        row = rows.setdefault(
            (p.trace, p.capacity.label()),
            {
                "trace": _short(p.trace),
                "capacity": p.capacity.label(),
                "blocks": p.capacity_blocks,
                "hit": {},
                "belady": p.belady.block_hit_rate if p.belady else None,
            },
        )
        row["hit"][p.policy] = p.counts.block_hit_rate
    for row in rows.values():
        hits = row["hit"]
        best = max(policies, key=hits.__getitem__)
        row["best"] = best
        row["best_minus_lru"] = hits[best] - hits.get("lru", hits[best])
        baseline = max(hits.get("lru", 0.0), hits.get("arc", 0.0))
        row["best_minus_max_lru_arc"] = hits[best] - baseline
        row["gap_to_belady"] = None if row["belady"] is None else row["belady"] - hits[best]
    return list(rows.values())


def _header(policy: str) -> str:
    return f"{policy} (default)" if policy == DEFAULT_POLICY else policy


def _table(rows: list[dict[str, Any]], policies: list[str]) -> Table:
    table = Table(title="block hit rate (%) by policy; * = best")
    for column in [
        "trace",
        "capacity",
        *map(_header, policies),
        "Belady",
        "best",
        "vs LRU",
        "vs max(LRU,ARC)",
        "gap",
    ]:
        table.add_column(column, justify="left" if column in ("trace", "best") else "right")
    for row in rows:
        cells = [row["trace"], row["capacity"]]
        for policy in policies:
            value = f"{100 * row['hit'][policy]:.2f}"
            cells.append(f"[bold]{value}*[/bold]" if policy == row["best"] else value)
        cells += [
            f"{100 * row['belady']:.2f}",
            row["best"],
            f"{100 * row['best_minus_lru']:+.2f}",
            f"{100 * row['best_minus_max_lru_arc']:+.2f}",
            f"{100 * row['gap_to_belady']:.2f}",
        ]
        table.add_row(*cells)
    return table


def _markdown(rows: list[dict[str, Any]], policies: list[str], timing: dict[str, Any]) -> str:
    head = [
        "trace",
        "capacity",
        *map(_header, policies),
        "Belady",
        "best",
        "best - LRU",
        "best - max(LRU, ARC)",
        "gap to Belady",
    ]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|",
    ]
    for row in rows:
        cells = [row["trace"], row["capacity"]]
        for policy in policies:
            value = f"{100 * row['hit'][policy]:.2f}"
            cells.append(f"**{value}**" if policy == row["best"] else value)
        cells += [
            f"{100 * row['belady']:.2f}",
            row["best"],
            f"{100 * row['best_minus_lru']:+.2f} pp",
            f"{100 * row['best_minus_max_lru_arc']:+.2f} pp",
            f"{100 * row['gap_to_belady']:.2f} pp",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    info = machine_info()
    command = " ".join(["python", "-m", "bench.replay", *sys.argv[1:]])
    lines += [
        "",
        f"Block hit rates in %, measured {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')} "
        f"on {info['cpu']} ({info['cpu_count']} CPUs, load average "
        f"{', '.join(f'{x:.1f}' for x in info['load_average'] or [])}), Python {info['python']}, "
        f"commit {str(info['git_commit'])[:10]}; command: `{command}`.",
        "",
        _timing_line(timing),
    ]
    return "\n".join(lines) + "\n"


START, END = "<!-- bench.replay:start -->", "<!-- bench.replay:end -->"


def _replace_section(path: Path, body: str) -> None:
    """Put ``body`` between the bench markers of ``path`` (appended when there are none)."""
    text = path.read_text() if path.exists() else ""
    block = f"{START}\n{body}{END}"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        tail = rest.split(END, 1)[1]
        text = head + block + tail
    else:
        text = (text + "\n" if text else "") + block + "\n"
    path.write_text(text)


def _time_each(trace: Trace, policies: list[str]) -> dict[str, Any]:
    """Wall and manager time of one replay of ``trace`` per policy at ``TIMED_CAPACITY``."""
    capacity = parse_capacities(TIMED_CAPACITY)[0]
    blocks = capacity.blocks(trace.num_unique_blocks)
    per_policy: dict[str, dict[str, float]] = {}
    for policy in policies:
        start = time.perf_counter()
        counts = replay_trace(make_manager(policy, blocks), trace)
        wall = time.perf_counter() - start
        per_policy[policy] = {"wall_s": wall, "manager_s": counts.manager_time_s}
    slowest = max(per_policy, key=lambda p: per_policy[p]["wall_s"])
    return {
        "trace": trace.name,
        "capacity": TIMED_CAPACITY,
        "capacity_blocks": blocks,
        "requests": trace.num_requests,
        "per_policy": per_policy,
        "slowest": slowest,
        "max_wall_s": per_policy[slowest]["wall_s"],
        "goal_s": TIME_GOAL_S,
        "goal_met": per_policy[slowest]["wall_s"] < TIME_GOAL_S,
    }


def _timing_line(timing: dict[str, Any]) -> str:
    times = ", ".join(f"{p} {t['wall_s']:.2f} s" for p, t in sorted(timing["per_policy"].items()))
    return (
        f"Replay time of the conversation trace at {timing['capacity']} "
        f"({timing['capacity_blocks']:,} blocks, {timing['requests']:,} requests), wall clock "
        f"per policy: {times}; slowest {timing['slowest']} {timing['max_wall_s']:.2f} s "
        f"(goal < {TIME_GOAL_S:.0f} s: {'met' if timing['goal_met'] else 'missed'})."
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__)
    parser.add_argument("--traces", type=Path, nargs="*", default=None)
    parser.add_argument("--policies", default="all")
    parser.add_argument("--capacities", default="1%,2%,5%,10%,20%")
    parser.add_argument(
        "--variants",
        default="lru+reuse2",
        help="extra columns not counted as policies, e.g. lru+reuse2 (reuse filter in front)",
    )
    parser.add_argument("--docs", type=Path, default=None, help="write PNG + markdown here")
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)

    console = Console(width=None if sys.stdout.isatty() else 200)
    paths = args.traces or default_trace_paths()
    traces = [load_trace(p) for p in paths]
    policies = (
        available_cache_policies()
        if args.policies == "all"
        else [p.strip() for p in args.policies.split(",") if p.strip()]
    )
    # LRU and ARC first: they are the baselines every other column is compared with.
    policies = sorted(policies, key=lambda p: (p not in ("lru", "arc"), p != "lru", p))
    capacities = parse_capacities(args.capacities)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for t in traces:
        console.print(
            f"{t.name}: {t.num_requests:,} requests, {t.num_block_accesses:,} block accesses, "
            f"{t.num_unique_blocks:,} unique blocks, infinite-cache hit rate "
            f"{100 * t.infinite_cache_hit_rate():.2f}%"
        )
    started = time.perf_counter()
    result = run_sweep(traces, [*policies, *variants], capacities)
    sweep_s = time.perf_counter() - started
    rows = _rows(result, policies)
    console.print(_table(rows, [*policies, *variants]))

    conversation = next((t for t in traces if "conversation" in t.name), traces[0])
    timing = _time_each(conversation, [*policies, *variants])
    console.print(_timing_line(timing) + f" Whole sweep {sweep_s:.1f} s.")
    beats_lru = all(r["best_minus_lru"] > 0 for r in rows)
    beats_both = sum(r["best_minus_max_lru_arc"] > 0 for r in rows)
    non_baseline = [p for p in policies if p not in ("lru", "arc")]
    console.print(
        f"best policy beats LRU at every point: {beats_lru}; beats max(LRU, ARC) at "
        f"{beats_both}/{len(rows)} points; non-baseline policies: {', '.join(non_baseline)}"
    )
    payload: dict[str, Any] = {
        "traces": [t.summary(p) for t, p in zip(traces, paths, strict=True)],
        "policies": policies,
        "variants": variants,
        "capacities": [c.label() for c in capacities],
        "sweep_s": sweep_s,
        "timing": timing,
        "summary": {
            "best_beats_lru_everywhere": beats_lru,
            "points_best_beats_max_lru_arc": beats_both,
            "points": len(rows),
        },
        "table": rows,
        "results": [p.to_dict() for p in result.points],
    }
    if not args.no_json:
        console.print(f"JSON written to {write_json('replay', payload)}")
    if args.docs is not None:
        args.docs.mkdir(parents=True, exist_ok=True)
        png = args.docs / "policy-lab-hit-rates.png"
        plot_result(result, png, default=DEFAULT_POLICY)
        md = args.docs / "policy-lab.md"
        table_md = _markdown(rows, [*policies, *variants], timing)
        _replace_section(md, table_md)
        console.print(f"plot written to {png}, table to {md}")
    return payload


if __name__ == "__main__":
    main()
