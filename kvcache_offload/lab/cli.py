"""``kvcache-offload replay``: hit rates of eviction policies on a trace, next to Belady."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from kvcache_offload.control.policies.registry import (
    available_cache_policies,
    get_cache_policy_cls,
)
from kvcache_offload.errors import OffloadError
from kvcache_offload.extras import require
from kvcache_offload.lab.sweep import (
    SweepResult,
    parse_capacities,
    run_sweep,
    split_policy,
)
from kvcache_offload.lab.trace import (
    Trace,
    default_trace_paths,
    load_trace,
)

__all__ = ["plot_result", "replay", "result_json", "result_tables"]

_PROGRESS_MIN_REQUESTS = 50_000
"""Show a progress bar when the sweep replays at least this many requests in total."""


def _policies(text: str | None) -> list[str]:
    if not text:
        return available_cache_policies()
    names = [p.strip() for p in text.split(",") if p.strip()]
    for name in names:
        get_cache_policy_cls(split_policy(name)[0])  # raises a clear UnknownPolicyError
    return names


def _short(name: str) -> str:
    marker = " (full blocks)"
    short = name.removesuffix(marker)
    for suffix in (".gz", ".jsonl", "_trace"):
        short = short.removesuffix(suffix)
    short = short.removeprefix("mooncake_")
    return short + marker if name.endswith(marker) else short


def result_tables(result: SweepResult, with_belady: bool) -> list[Table]:
    """One table per trace, one row per (capacity, policy); the best policy is starred."""
    best = result.best_per_point()
    any_rejected = any(p.counts.rejected_stores for p in result.points)
    tables: dict[str, Table] = {}
    for p in result.points:
        table = tables.get(p.trace)
        if table is None:
            table = tables[p.trace] = Table(title=f"replay {_short(p.trace)}")
            columns = ["capacity", "blocks", "policy", "block hit", "token hit"]
            if with_belady:
                columns += ["Belady", "gap"]
            columns += ["evictions"] + (["rejected"] if any_rejected else []) + ["Mblk/s"]
            for column in columns:
                table.add_column(column, justify="left" if column == "policy" else "right")
        is_best = best[(p.trace, p.capacity.label())] == p.policy
        row = [
            p.capacity.label(),
            f"{p.capacity_blocks:,}",
            f"[bold]{p.policy}*[/bold]" if is_best else p.policy,
            f"{100 * p.counts.block_hit_rate:.2f}%",
            f"{100 * p.counts.token_hit_rate:.2f}%",
        ]
        if with_belady and p.belady is not None and p.gap is not None:
            row += [f"{100 * p.belady.block_hit_rate:.2f}%", f"{100 * p.gap:.2f}pp"]
        row.append(f"{p.counts.evictions:,}")
        if any_rejected:
            row.append(f"{p.counts.rejected_stores:,}")
        row.append(f"{p.counts.blocks_per_s / 1e6:.2f}")
        table.add_row(*row)
    return list(tables.values())


def result_json(
    result: SweepResult, traces: list[Trace], paths: list[Path], extra: dict[str, Any]
) -> dict[str, Any]:
    """Everything needed to reproduce and compare a sweep."""
    return {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "traces": [t.summary(p) for t, p in zip(traces, paths, strict=True)],
        **extra,
        "best_policy": [
            {"trace": trace, "capacity": cap, "policy": policy}
            for (trace, cap), policy in result.best_per_point().items()
        ],
        "results": [p.to_dict() for p in result.points],
    }


def plot_result(result: SweepResult, path: Path, default: str | None = None) -> None:
    """Hit rate vs capacity per trace; percentage capacities on the x axis when given.

    ``default`` (the service's default policy) is labelled as such in the legend."""
    from kvcache_offload.lab.plot import plot_hit_rates

    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    all_percent = all(p.capacity.percent for p in result.points)
    for p in result.points:
        x = p.capacity.value if all_percent else float(p.capacity_blocks)
        series = panels.setdefault(_short(p.trace), {})
        label = f"{p.policy} (default)" if p.policy == default else p.policy
        series.setdefault(label, []).append((x, p.counts.block_hit_rate))
        if p.belady is not None:
            bound = series.setdefault("belady", [])
            if (x, p.belady.block_hit_rate) not in bound:
                bound.append((x, p.belady.block_hit_rate))
    xlabel = "CPU capacity (% of unique blocks)" if all_percent else "CPU capacity (blocks)"
    plot_hit_rates(panels, path, xlabel=xlabel)


def _check_writable(path: Path) -> None:
    """Fail before a long replay, not after it, when an output file cannot be written."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise OffloadError(f"cannot write {path}: it is a directory")
    if not parent.is_dir():
        raise OffloadError(f"cannot write {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise OffloadError(f"cannot write {path}: permission denied")


def replay(
    traces: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Mooncake JSONL traces or recorded request logs (default: the traces in "
            "$KVCACHE_OFFLOAD_TRACE_DIR when set, else the shipped sample).",
            show_default=False,
        ),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            "-p",
            help="Comma-separated policies (default: all registered); NAME+reuseN puts the "
            "reuse filter with store threshold N in front of NAME, e.g. lru+reuse2.",
        ),
    ] = None,
    capacity: Annotated[
        str,
        typer.Option(
            "--capacity", "-c", help="Comma-separated capacities: '5%' of unique blocks or blocks."
        ),
    ] = "1%,5%,10%,25%",
    reuse_threshold: Annotated[
        int | None,
        typer.Option(help="Wrap the manager in the reuse filter with this store threshold."),
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write all results as JSON here.")
    ] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG plot here.")] = None,
    no_belady: Annotated[
        bool, typer.Option("--no-belady", help="Skip the offline-optimal bound.")
    ] = False,
    full_blocks_only: Annotated[
        bool,
        typer.Option(
            "--full-blocks-only",
            help="Drop each prompt's partial last block, as vLLM keys only full blocks.",
        ),
    ] = False,
    progress: Annotated[
        bool | None,
        typer.Option("--progress/--no-progress", help="Progress bar (default: on long runs)."),
    ] = None,
) -> None:
    """Replay request traces through the real CPU manager for each policy and capacity."""
    console = Console(width=None if sys.stdout.isatty() else 140)
    try:
        paths = list(traces) if traces else default_trace_paths()
        policies = _policies(policy)
        capacities = parse_capacities(capacity)
        if plot is not None:
            require("plot", "replay --plot")
        for out in (json_out, plot):
            if out is not None:
                _check_writable(out)
        loaded = [load_trace(p) for p in paths]
        if full_blocks_only:
            loaded = [t.without_partial_blocks() for t in loaded]
    except (OffloadError, OSError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None

    total = sum(t.num_requests for t in loaded) * len(policies) * len(capacities)
    show = progress if progress is not None else total >= _PROGRESS_MIN_REQUESTS
    started = time.perf_counter()
    with Progress(
        TextColumn("replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not show,
        transient=True,
    ) as bar:
        task = bar.add_task("replay", total=total)
        result = run_sweep(
            loaded,
            policies,
            capacities,
            reuse_threshold=reuse_threshold,
            with_belady=not no_belady,
            progress=(lambda n: bar.advance(task, n)) if show else None,
        )
    elapsed = time.perf_counter() - started

    for table in result_tables(result, with_belady=not no_belady):
        console.print(table)
    for t in loaded:
        if t.observed_block_hits is not None and t.num_block_accesses:
            console.print(
                f"{_short(t.name)}: the recording service saw "
                f"{100 * t.observed_block_hits / t.num_block_accesses:.2f}% block hits "
                f"({t.observed_block_hits:,} of {t.num_block_accesses:,})"
            )
    console.print(
        "* best policy at that capacity; gap = Belady minus policy block hit rate; "
        "Mblk/s = requested blocks per second of manager time. "
        f"{len(result.points)} replays in {elapsed:.1f} s."
    )
    if json_out is not None:
        extra = {
            "policies": policies,
            "reuse_threshold": reuse_threshold,
            "full_blocks_only": full_blocks_only,
        }
        data = result_json(result, loaded, paths, extra)
        json_out.write_text(json.dumps(data, indent=2) + "\n")
        console.print(f"JSON written to {json_out}")
    if plot is not None:
        plot_result(result, plot)
        console.print(f"plot written to {plot}")
