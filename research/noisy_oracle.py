"""How well must a policy know when blocks return? MIN driven by noisy return times.

    python -m research.noisy_oracle [--traces PATH,...] [--capacities 1%,2%,5%,10%]
                                 [--sigmas 0,0.25,0.5,1,2,4] [--seed 0]

The policy lab's bar is a policy that closes a quarter of the LRU -> Belady gap. No policy
reaches it on the synthetic trace without hints, and knowing how often each block is used is
not enough either (a hindsight-optimal static cache stayed under the bar).
This measures what would be: the offline-optimal schedule (MIN with bypass,
``kvcache_offload.lab.belady``) driven not by the true next use of each access but by a
prediction of it whose distance is off by a log-normal factor, ``exp(sigma * z)`` with ``z``
standard normal (sigma 0: MIN itself; sigma 1: a typical prediction off by 2.7x either
way). Blocks never used again get a distance past the trace's end, perturbed the same way.
For each trace and capacity it prints the LRU hit rate (the lab's replay through the real
manager), MIN's, and for each sigma the noisy schedule's hit rate and the share of the gap it
closes, and writes JSON under ``bench/out/``. Hit rates here are the lab's block hit rates;
MIN's count every cached block as in ``belady_hits``.
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvcache_offload.control.manager import CPUOffloadingManager
from kvcache_offload.lab.belady import belady_hits, next_use_positions
from kvcache_offload.lab.driver import replay_trace
from kvcache_offload.lab.sweep import parse_capacities
from kvcache_offload.lab.trace import Trace, default_trace_paths, load_trace
from research._output import write_json

console = Console()


def noisy_next_use(accesses: list[int], sigma: float, seed: int) -> list[int]:
    """Each access's next-use position with its distance scaled by ``exp(sigma * z)``."""
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    true = next_use_positions(accesses)
    if sigma == 0:
        return true
    rng = random.Random(seed)
    gauss = rng.gauss
    return [
        i + max(1, round((use - i) * math.exp(sigma * gauss(0.0, 1.0))))
        for i, use in enumerate(true)
    ]


def lru_hit_rate(trace: Trace, capacity: int) -> float:
    """The lab's LRU block hit rate (percent): the trace replayed through the manager."""
    counts = replay_trace(CPUOffloadingManager(capacity, "lru"), trace)
    return 100.0 * counts.block_hit_rate


def measure(
    trace: Trace, capacities: list[tuple[str, int]], sigmas: list[float], seed: int
) -> list[dict[str, Any]]:
    """One row per capacity: LRU, MIN, and each sigma's hit rate and share of the gap."""
    accesses = [b for ids in trace.block_ids for b in ids]
    predictions = {s: noisy_next_use(accesses, s, seed) for s in sigmas}
    rows = []
    for label, capacity in capacities:
        lru = lru_hit_rate(trace, capacity)
        best = 100.0 * belady_hits(trace, capacity).block_hit_rate
        gap = best - lru
        noisy = {}
        for sigma in sigmas:
            rate = (
                100.0
                * belady_hits(trace, capacity, predicted_next_use=predictions[sigma]).block_hit_rate
            )
            noisy[sigma] = {
                "hit_rate": rate,
                "gap_share": (rate - lru) / gap if gap > 0 else float("nan"),
            }
        rows.append({"capacity": label, "blocks": capacity, "lru": lru, "belady": best,
                     "noisy": noisy})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m research.noisy_oracle", description=__doc__)
    parser.add_argument("--traces", default="", help="comma-separated; default: the shipped")
    parser.add_argument("--capacities", default="1%,2%,5%,10%")
    parser.add_argument("--sigmas", default="0,0.25,0.5,1,2,4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.traces.split(",") if p] or default_trace_paths()
    sigmas = [float(s) for s in args.sigmas.split(",") if s]
    out: dict[str, Any] = {"args": vars(args), "traces": []}
    for path in paths:
        trace = load_trace(path)
        unique = len({k for ks in trace.keys for k in ks})
        capacities = [(c.label(), c.blocks(unique)) for c in parse_capacities(args.capacities)]
        rows = measure(trace, capacities, sigmas, args.seed)
        table = Table(title=f"{path.name}: MIN driven by return times off by exp(sigma * z)")
        table.add_column("capacity")
        table.add_column("LRU")
        table.add_column("Belady")
        for sigma in sigmas:
            table.add_column(f"sigma {sigma:g}")
        for row in rows:
            cells = [
                f"{row['noisy'][s]['hit_rate']:.2f} ({row['noisy'][s]['gap_share']:.0%})"
                for s in sigmas
            ]
            table.add_row(
                f"{row['capacity']} ({row['blocks']})", f"{row['lru']:.2f}",
                f"{row['belady']:.2f}", *cells,
            )  # fmt: skip
        console.print(table)
        out["traces"].append({"trace": path.name, "unique_blocks": unique, "rows": rows})
    console.print("cells: block hit rate % (share of the LRU -> Belady gap closed)")
    if not args.no_json:
        write_json("noisy-oracle", out)
    return out


if __name__ == "__main__":
    main()
