"""Ceilings for families of eviction rules: rules that are told part of the future.

    python -m research.policy_oracles [--capacities 1%,2%,5%,10%]

Each oracle runs in ``research.policy_candidates``' simulator of the replay driver on a whole
shipped trace and gets one piece of the future that an online rule could at best estimate:

* ``future-count``: least frequently used, where a block's count is its number of accesses
  over the *whole* trace, past and future (perfect popularity; ties go LRU). No rule that
  ranks blocks by an estimate of their popularity does better than a perfect estimate of it.
* ``remaining-count``: least remaining accesses first (the accesses still to come, counted
  down as they happen; ties LRU): perfect knowledge of how often, but not when.
* ``dead-bypass``: LRU that never keeps a block with no access left (perfect admission and
  dead-block eviction; everything else LRU).

Belady (MIN with bypass) knows *when*; the share of the LRU -> Belady gap each oracle closes
shows how much of the gap is about how often or whether, and how much only about when.
Writes ``bench/out/policy-oracles-*.json``.
"""

from __future__ import annotations

import argparse
import heapq
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvcache_offload.lab.belady import belady_hits
from kvcache_offload.lab.sweep import parse_capacities
from kvcache_offload.lab.trace import default_trace_paths, load_trace
from research._output import write_json
from research.policy_candidates import LRU, pop_victims, replay


class _CountLFU:
    """Evict the lowest count (ties: least recent); ``remaining`` counts down on each use."""

    def __init__(self, cap: int, counts: dict[int, int], remaining: bool) -> None:
        self.cap = cap
        self.counts = dict(counts)
        self.remaining = remaining
        self.now = 0
        self.entry: dict[int, tuple[int, int, int]] = {}
        self.heap: list[tuple[int, int, int]] = []

    def __contains__(self, key: int) -> bool:
        return key in self.entry

    def _push(self, key: int) -> None:
        self.now += 1
        e = (self.counts[key], self.now, key)
        self.entry[key] = e
        heapq.heappush(self.heap, e)

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        if self.remaining and not new:  # the request's first touch: one access of each key
            for k in keys:
                self.counts[k] -= 1
        for k in reversed(keys):
            if k in self.entry and k not in new:
                self._push(k)

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        need = len(self.entry) + len(keys) - self.cap
        for _ in pop_victims(self.heap, self.entry, need, protected):
            pass
        for k in reversed(keys):
            self._push(k)


class _DeadBypassLRU(LRU):
    """LRU that drops every block whose last access has passed, and never stores one."""

    def __init__(self, cap: int, counts: dict[int, int]) -> None:
        super().__init__(cap)
        self.left = dict(counts)

    def touch(self, keys: Sequence[int], new: frozenset[int]) -> None:
        if not new:
            for k in keys:
                self.left[k] -= 1
        super().touch(keys, new)
        for k in keys:
            if self.left[k] == 0 and k in self.q:
                del self.q[k]

    def store(self, keys: Sequence[int], protected: set[int]) -> None:
        super().store([k for k in keys if self.left[k] > 0], protected)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m research.policy_oracles", description=__doc__)
    parser.add_argument("--capacities", default="1%,2%,5%,10%")
    args = parser.parse_args(argv)
    rows = []
    for path in default_trace_paths():
        trace = load_trace(path)
        name = trace.name.removeprefix("mooncake_").split("_")[0]
        counts = dict(Counter(k for keys in trace.block_ids for k in keys))
        for capacity in parse_capacities(args.capacities):
            blocks = capacity.blocks(trace.num_unique_blocks)
            bound = belady_hits(trace, blocks).block_hit_rate
            policies: dict[str, Any] = {
                "lru": LRU(blocks),
                "future-count": _CountLFU(blocks, counts, remaining=False),
                "remaining-count": _CountLFU(blocks, counts, remaining=True),
                "dead-bypass": _DeadBypassLRU(blocks, counts),
            }
            hit = {n: replay(trace.block_ids, p) for n, p in policies.items()}
            lru = hit["lru"]
            share = {n: (h - lru) / (bound - lru) for n, h in hit.items()}
            rows.append(
                {"trace": name, "capacity": capacity.label(), "blocks": blocks,
                 "belady": bound, "hit": hit, "gap_closed": share}
            )  # fmt: skip
            cells = " ".join(f"{n}={100 * h:.2f}({100 * share[n]:+.0f}%)" for n, h in hit.items())
            print(f"{name} {capacity.label()}: Belady={100 * bound:.2f} {cells}", flush=True)
    result = {"rows": rows}
    write_json("policy-oracles", result)
    return result


if __name__ == "__main__":
    main()
