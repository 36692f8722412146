"""Replay traces for every (policy, capacity) pair and put Belady next to each result.

Shared by the ``replay`` command and ``bench/replay.py`` so both report the same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcache_offload.contracts.manager import OffloadingManager
from kvcache_offload.control.manager import CPUOffloadingManager
from kvcache_offload.control.reuse_filter import FilterReusedOffloadingManager
from kvcache_offload.errors import ConfigError
from kvcache_offload.lab.belady import (
    BeladyResult,
    belady_hits,
)
from kvcache_offload.lab.driver import (
    ProgressFn,
    ReplayCounts,
    replay_trace,
)
from kvcache_offload.lab.trace import Trace

__all__ = [
    "Capacity",
    "SweepPoint",
    "SweepResult",
    "make_manager",
    "parse_capacities",
    "run_sweep",
    "split_policy",
]


@dataclass(frozen=True)
class Capacity:
    """A capacity as given by the user: a percentage of the trace's unique blocks, or blocks."""

    value: float
    percent: bool

    def blocks(self, num_unique_blocks: int) -> int:
        if not self.percent:
            return int(self.value)
        return max(1, round(num_unique_blocks * self.value / 100))

    def label(self) -> str:
        return f"{self.value:g}%" if self.percent else f"{int(self.value)}"


def parse_capacities(text: str) -> list[Capacity]:
    """Parse ``"1%,5%,10%"`` or ``"1000,5000"`` (mixing is allowed)."""
    out: list[Capacity] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        percent = item.endswith("%")
        number = item[:-1] if percent else item
        try:
            value = float(number) if percent else int(number)
        except ValueError:
            raise ConfigError(
                f"capacity {item!r} is neither a percentage like '5%' nor a block count"
            ) from None
        if value <= 0 or (percent and value > 1000):
            raise ConfigError(f"capacity {item!r} must be > 0 (and at most 1000%)")
        out.append(Capacity(float(value), percent))
    if not out:
        raise ConfigError(f"no capacity given in {text!r}")
    return out


@dataclass
class SweepPoint:
    """One replay: a trace, a policy and a capacity, with the Belady bound for it."""

    trace: str
    policy: str
    capacity: Capacity
    capacity_blocks: int
    counts: ReplayCounts
    belady: BeladyResult | None
    wall_time_s: float

    @property
    def gap(self) -> float | None:
        """Belady's block hit rate minus this policy's (percentage points / 100)."""
        if self.belady is None:
            return None
        return self.belady.block_hit_rate - self.counts.block_hit_rate

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "trace": self.trace,
            "policy": self.policy,
            "capacity": self.capacity.label(),
            "capacity_percent": self.capacity.value if self.capacity.percent else None,
            "capacity_blocks": self.capacity_blocks,
            "wall_time_s": self.wall_time_s,
            **self.counts.to_dict(),
        }
        if self.belady is not None:
            out["belady_block_hits"] = self.belady.block_hits
            out["belady_block_hit_rate"] = self.belady.block_hit_rate
            out["belady_token_hit_rate"] = self.belady.token_hit_rate
            out["gap_to_belady"] = self.gap
        return out


@dataclass
class SweepResult:
    points: list[SweepPoint] = field(default_factory=list)
    belady: dict[tuple[str, int], BeladyResult] = field(default_factory=dict)

    def best_per_point(self) -> dict[tuple[str, str], str]:
        """(trace, capacity label) -> the policy with the highest block hit rate."""
        best: dict[tuple[str, str], SweepPoint] = {}
        for point in self.points:
            key = (point.trace, point.capacity.label())
            if key not in best or point.counts.block_hit_rate > best[key].counts.block_hit_rate:
                best[key] = point
        return {key: point.policy for key, point in best.items()}


def split_policy(spec: str) -> tuple[str, int | None]:
    """``"lru"`` -> ("lru", None); ``"lru+reuse2"`` -> ("lru", 2): the policy behind the reuse
    filter with that store threshold."""
    name, sep, suffix = spec.partition("+reuse")
    if not sep:
        return spec, None
    try:
        threshold = int(suffix)
    except ValueError:
        raise ConfigError(
            f"policy {spec!r}: expected NAME+reuseN with an integer N, e.g. 'lru+reuse2'"
        ) from None
    return name, threshold


def make_manager(spec: str, capacity: int, reuse_threshold: int | None = None) -> OffloadingManager:
    """A fresh CPU manager for ``spec`` (see :func:`split_policy`), optionally behind the reuse
    filter (``reuse_threshold`` applies to every policy without its own ``+reuseN``)."""
    name, own_threshold = split_policy(spec)
    threshold = own_threshold if own_threshold is not None else reuse_threshold
    manager: OffloadingManager = CPUOffloadingManager(capacity, name)
    if threshold is not None:
        manager = FilterReusedOffloadingManager(manager, store_threshold=threshold)
    return manager


def run_sweep(
    traces: Sequence[Trace],
    policies: Sequence[str],
    capacities: Sequence[Capacity],
    reuse_threshold: int | None = None,
    with_belady: bool = True,
    progress: ProgressFn | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> SweepResult:
    """Replay each trace through a fresh manager for every policy and capacity."""
    result = SweepResult()
    for trace in traces:
        for capacity in capacities:
            blocks = capacity.blocks(trace.num_unique_blocks)
            bound = None
            if with_belady:
                bound = result.belady.get((trace.name, blocks))
                if bound is None:
                    bound = result.belady[(trace.name, blocks)] = belady_hits(trace, blocks)
            for policy in policies:
                manager = make_manager(policy, blocks, reuse_threshold)
                start = time.perf_counter()
                counts = replay_trace(manager, trace, progress=progress)
                wall = time.perf_counter() - start
                point = SweepPoint(trace.name, policy, capacity, blocks, counts, bound, wall)
                result.points.append(point)
                if on_point is not None:
                    on_point(point)
    return result
