"""Share of the LRU -> Belady gap each policy closes, on whole traces and on slices.

    python -m research.policy_gap [--policies lru,alru,lru2,s3fifo-prefix,adaptive]
                               [--capacities 1%,2%,5%,10%,20%,3%,7%,15%] [--slices 2]
                               [--markdown]

Replays each shipped trace, and with ``--slices N`` each N-th of it on its own (held-out
traffic: the policies' parameters were not chosen on the slices), through the real manager
with the policy lab's driver, at every capacity (percent of that trace's or slice's unique
blocks), and puts Belady (MIN with bypass) next to them. Each cell is the block hit rate and,
in brackets, the share of the LRU -> Belady gap closed ((policy - LRU) / (Belady - LRU);
negative: below LRU). Writes ``bench/out/policy-gap-*.json``; ``--markdown`` prints the
table for ``docs/policy-lab.md``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvcache_offload.lab.belady import belady_hits
from kvcache_offload.lab.driver import replay_trace
from kvcache_offload.lab.sweep import make_manager, parse_capacities
from kvcache_offload.lab.trace import (
    Trace,
    default_trace_paths,
    iter_requests,
    load_trace,
    trace_from_requests,
)
from research._output import write_json


def _parts(path: Any, slices: int) -> list[tuple[str, Trace]]:
    whole = load_trace(path)
    parts = [("all", whole)]
    if slices > 1:
        requests = list(iter_requests(path))
        size = -(-len(requests) // slices)
        for i in range(slices):
            chunk = requests[i * size : (i + 1) * size]
            parts.append((f"{i + 1}/{slices}", trace_from_requests(chunk, whole.name)))
    return parts


def _cell(hit: float, lru: float, bound: float) -> str:
    gap = bound - lru
    share = f" ({100 * (hit - lru) / gap:+.0f}%)" if gap > 0 else ""
    return f"{100 * hit:.2f}{share}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m research.policy_gap", description=__doc__)
    parser.add_argument("--policies", default="lru,alru,lru2,s3fifo-prefix,adaptive")
    parser.add_argument("--capacities", default="1%,2%,5%,10%,20%,3%,7%,15%")
    parser.add_argument("--slices", type=int, default=1, help="also replay each 1/N of a trace")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if "lru" not in policies:
        policies.insert(0, "lru")
    rows: list[dict[str, Any]] = []
    for path in default_trace_paths():
        for label, trace in _parts(path, args.slices):
            for capacity in parse_capacities(args.capacities):
                blocks = capacity.blocks(trace.num_unique_blocks)
                bound = belady_hits(trace, blocks).block_hit_rate
                hit = {
                    p: replay_trace(make_manager(p, blocks), trace).block_hit_rate for p in policies
                }
                lru = hit["lru"]
                row: dict[str, Any] = {
                    "trace": trace.name.removeprefix("mooncake_").split("_")[0],
                    "slice": label,
                    "capacity": capacity.label(),
                    "blocks": blocks,
                    "belady": bound,
                    "hit": hit,
                    "gap_closed": {
                        p: (h - lru) / (bound - lru) if bound > lru else 0.0 for p, h in hit.items()
                    },
                }
                rows.append(row)
                cells = " ".join(f"{p}={_cell(h, lru, bound)}" for p, h in hit.items())
                print(
                    f"{row['trace']} {label} {capacity.label()}: Belady={100 * bound:.2f} {cells}",
                    flush=True,
                )
    if args.markdown:
        head = ["trace", "slice", "capacity", "Belady", *policies]
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---" if i < 3 else "---:" for i in range(len(head))) + "|")
        for row in rows:
            lru, bound = row["hit"]["lru"], row["belady"]
            line = [row["trace"], row["slice"], row["capacity"], f"{100 * bound:.2f}"]
            line += [_cell(row["hit"][p], lru, bound) for p in policies]
            print("| " + " | ".join(line) + " |")
    result = {"policies": policies, "command": " ".join(sys.argv), "rows": rows}
    write_json("policy-gap", result)
    return result


if __name__ == "__main__":
    main()
