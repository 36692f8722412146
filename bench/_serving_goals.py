"""The serving goals (job latency over its floor, stream rates over the link), checked
against one ``bench.serving`` layout's rows of the default column.

Each check reads the rows ``bench.serving.report`` builds (single jobs and streams, with the
floors measured in the same run), so the goals table of a run is computed, not written by
hand. A stream's share is of the one-way bulk copy in its own direction (to the CPU for
stores, to the GPU for loads and the mixed row: ``bench.serving.stream_bulk``). The CPU
device has one goal: every stream at 0.7 of one thread copying the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Goal", "check_goals"]


@dataclass(frozen=True)
class Goal:
    goal: str
    value: str
    met: bool


def _single(rows: list[dict[str, Any]], column: str) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["direction"], r["blocks"]): r for r in rows if r["mechanism"] == column}


def _streams(rows: list[dict[str, Any]], column: str) -> dict[str, dict[str, Any]]:
    return {r["stream"]: r for r in rows if r["mechanism"] == column}


def check_goals(
    single_rows: list[dict[str, Any]],
    stream_rows: list[dict[str, Any]],
    device: str,
    column: str = "auto",
) -> list[Goal]:
    """The goals for ``column``'s rows (nothing when the run has no such column)."""
    streams = _streams(stream_rows, column)
    if not streams:
        return []
    if device != "cuda":
        worst = min(streams.values(), key=lambda r: r["ratio_to_one_way_bulk"])
        return [
            Goal(
                "every stream at 0.7 of a one-thread copy",
                f"lowest {worst['ratio_to_one_way_bulk']:.2f} ({worst['stream']})",
                worst["ratio_to_one_way_bulk"] >= 0.7,
            )
        ]
    out: list[Goal] = []
    single = _single(single_rows, column)
    for direction in ("load", "store"):
        row = single.get((direction, 1))
        if row is not None:
            extra_us = (row["p50_s"] - row["floor_p50_s"]) * 1e6
            out.append(Goal(f"1-block {direction} p50 <= floor + 40 us", f"+{extra_us:.0f} us",
                            extra_us <= 40))  # fmt: skip
        for blocks in (8, 64):
            row = single.get((direction, blocks))
            if row is not None:
                out.append(Goal(f"{blocks}-block {direction} p50 <= 1.15x floor",
                                f"{row['ratio_p50']:.2f}x", row["ratio_p50"] <= 1.15))  # fmt: skip
    tails = [f"{r['direction']} {r['blocks']}" for r in single.values()
             if r["p99_s"] > 1.5 * r["p50_s"] + 100e-6]  # fmt: skip
    out.append(Goal("single-job p99 <= 1.5 x p50 + 100 us",
                    ", ".join(tails) + " over" if tails else "all", not tails))  # fmt: skip
    wanted = (("loads 4-block", 0.90), ("stores 4-block", 0.90), ("mixed 4-block", 1.6),
              ("loads 1-block", 0.80))  # fmt: skip
    for name, share in wanted:
        row = streams.get(name)
        if row is not None:
            out.append(Goal(f"{name} stream >= {share:g} x one-way bulk",
                            f"{row['ratio_to_one_way_bulk']:.2f}",
                            row["ratio_to_one_way_bulk"] >= share))  # fmt: skip
    late = [r["stream"] for r in streams.values() if r["p99_s"] > r["p99_bound_s"]]
    out.append(Goal("stream p99 <= 2 x bytes in flight / bulk",
                    ", ".join(late) + " over" if late else "all", not late))  # fmt: skip
    dearest = max(streams.values(), key=lambda r: r["cpu_cores"])
    cores = dearest["cpu_cores"]
    # Which stream, and how much of it the event-loop thread (the poller and every
    # submission) took: the rest is other threads (watchers, copy threads, the runtime's).
    loop = (dearest.get("thread_cores") or {}).get("loop")
    where = dearest["stream"] + (f", loop thread {loop:.2f}" if loop is not None else "")
    # Compared as shown, to 0.01 of a core: a stream bound by the event-loop thread keeps it
    # busy throughout, and the process then reads 1.000-1.001 cores (the other threads'
    # wake-ups), which is one core at the precision the table reports.
    out.append(Goal("a stream costs at most one core", f"up to {cores:.2f} ({where})",
                    round(cores, 2) <= 1.0))  # fmt: skip
    return out
