"""Replay a trace through a CPU tier with secondary tiers below it: hit rate by tier.

    python -m kvcache_offload.lab.tiered TRACE [--policy lru] [--cpu 5%]
                                            [--tiers 20%,100%] [--write through,back]

The CPU tier is the real manager (as in :mod:`kvcache_offload.lab.driver`); each secondary
tier is an LRU of a fixed number of blocks (the disk tier's own policy; Redis with
``allkeys-lru`` approximates one), ordered as the engine orders them. Per request, like the
engine:

1. Walk the keys: a key ready in the CPU tier is a CPU hit, else the first tier holding it
   gives a hit in that tier (prefix semantics across tiers); the first key held nowhere ends
   the walk.
2. ``touch``; load the CPU part; promote the tier part into CPU slots (a store the tiers are
   not written back from); store the misses.
3. Write-through: every stored block (not promoted ones) goes to every tier at once.
   Write-back: a block goes to the tiers when the CPU tier evicts it, unless it came from a
   tier and has not been written since.

The output is the block hit rate per tier and the blocks written per tier, for each write mode:
the data behind the default (see docs/tiers.md).
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcache_offload.contracts.manager import ReqContext
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.lab.sweep import (
    make_manager,
    parse_capacities,
)
from kvcache_offload.lab.trace import (
    Trace,
    load_trace,
)

__all__ = ["TieredCounts", "replay_tiered"]


class _LruTier:
    """A block-count-bounded LRU set standing in for one secondary tier."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[OffloadKey, None] = OrderedDict()
        self.writes = 0

    def get(self, key: OffloadKey) -> bool:
        if key in self.keys:
            self.keys.move_to_end(key)
            return True
        return False

    def put(self, key: OffloadKey) -> None:
        self.writes += 1
        if key in self.keys:
            self.keys.move_to_end(key)
            return
        self.keys[key] = None
        if len(self.keys) > self.capacity:
            self.keys.popitem(last=False)


@dataclass
class TieredCounts:
    """Hits by tier (``"CPU"`` first) and blocks written to each secondary tier."""

    write_mode: str
    blocks: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    writes: dict[str, int] = field(default_factory=dict)
    promoted: int = 0

    def hit_rate(self, tier: str | None = None) -> float:
        total = sum(self.hits.values()) if tier is None else self.hits.get(tier, 0)
        return total / self.blocks if self.blocks else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "write_mode": self.write_mode,
            "blocks": self.blocks,
            "hits": dict(self.hits),
            "hit_rate": {t: self.hit_rate(t) for t in self.hits} | {"total": self.hit_rate()},
            "writes": dict(self.writes),
            "promoted": self.promoted,
        }


def replay_tiered(
    trace: Trace,
    cpu_blocks: int,
    tier_blocks: Sequence[int],
    write_mode: str = "through",
    policy: str = "lru",
    tier_names: Sequence[str] | None = None,
) -> TieredCounts:
    """Replay ``trace``; ``tier_blocks[i]`` is the capacity of the i-th tier below the CPU."""
    if write_mode not in ("through", "back"):
        raise ValueError(f"write_mode must be 'through' or 'back', got {write_mode!r}")
    names = list(tier_names or [f"tier{i + 1}" for i in range(len(tier_blocks))])
    tiers = [_LruTier(c) for c in tier_blocks]
    manager = make_manager(policy, cpu_blocks)
    ctx = ReqContext("tiered-replay")
    counts = TieredCounts(write_mode, hits={"CPU": 0} | {n: 0 for n in names})
    from_tier: set[OffloadKey] = set()
    """Write-back: CPU blocks that came up from a tier and need not go down again."""

    def write_down(keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            for tier in tiers:
                tier.put(key)

    for keys in trace.keys:
        counts.blocks += len(keys)
        cpu_part: list[OffloadKey] = []
        promote: list[OffloadKey] = []
        hit = 0
        for key in keys:
            if manager.lookup(key, ctx) is True:
                cpu_part.append(key)
                counts.hits["CPU"] += 1
            else:
                where = next((i for i, t in enumerate(tiers) if t.get(key)), None)
                if where is None:
                    break
                promote.append(key)
                counts.hits[names[where]] += 1
            hit += 1
        manager.touch(keys, ctx)
        if cpu_part:
            manager.prepare_load(cpu_part, ctx)
            manager.complete_load(cpu_part, ctx)
        # Promotions and misses are both stores into the CPU tier (promotions first).
        for batch, promoted in ((promote, True), (list(keys[hit:]), False)):
            if not batch:
                continue
            out = manager.prepare_store(batch, ctx)
            if out is None:
                continue
            if write_mode == "back":
                write_down([k for k in out.evicted_keys if k not in from_tier])
                from_tier.difference_update(out.evicted_keys)
            if out.keys_to_store:
                manager.touch(keys, ctx)
                manager.complete_store(out.keys_to_store, ctx)
                if promoted:
                    counts.promoted += len(out.keys_to_store)
                    from_tier.update(out.keys_to_store)
                elif write_mode == "through":
                    write_down(out.keys_to_store)
    counts.writes = {n: t.writes for n, t in zip(names, tiers, strict=True)}
    return counts


def main(argv: list[str] | None = None) -> list[TieredCounts]:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(
        prog="python -m kvcache_offload.lab.tiered", description=__doc__
    )
    parser.add_argument("trace")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--cpu", default="5%", help="CPU tier: %% of unique blocks or blocks")
    parser.add_argument("--tiers", default="20%,100%", help="tiers below, in order")
    parser.add_argument("--names", default=None, help="tier names, e.g. disk,redis")
    parser.add_argument("--write", default="through,back", help="write modes to compare")
    args = parser.parse_args(argv)
    trace = load_trace(args.trace)
    (cpu,) = parse_capacities(args.cpu)
    tier_caps = parse_capacities(args.tiers)
    names = args.names.split(",") if args.names else None
    unique = trace.num_unique_blocks
    results = [
        replay_tiered(
            trace,
            cpu.blocks(unique),
            [c.blocks(unique) for c in tier_caps],
            mode.strip(),
            args.policy,
            names,
        )
        for mode in args.write.split(",")
    ]
    tier_labels = names or [f"tier{i + 1}" for i in range(len(tier_caps))]
    table = Table(
        title=f"{trace.name}: CPU {cpu.label()} + "
        + " + ".join(f"{n} {c.label()}" for n, c in zip(tier_labels, tier_caps, strict=True))
        + f" of {unique} unique blocks, policy {args.policy}"
    )
    table.add_column("write")
    for label in ("total hit rate", "CPU", *tier_labels):
        table.add_column(label, justify="right")
    for label in tier_labels:
        table.add_column(f"writes {label}", justify="right")
    for r in results:
        table.add_row(
            r.write_mode,
            f"{r.hit_rate():.3f}",
            f"{r.hit_rate('CPU'):.3f}",
            *(f"{r.hit_rate(t):.3f}" for t in tier_labels),
            *(f"{r.writes[t]:,}" for t in tier_labels),
        )
    Console(width=160).print(table)
    return results


if __name__ == "__main__":
    main()
