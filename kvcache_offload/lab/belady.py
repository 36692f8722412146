"""Offline-optimal (Belady/MIN) block hit rate: the ceiling every policy is measured against.

What exactly is bounded
-----------------------
The trace is flattened into its sequence of block accesses (request after request, keys in
prefix order). A cache of ``capacity`` blocks serves it with MIN: on a miss the block is
admitted unless its next use lies further ahead than that of every cached block (then it is
not admitted, "bypass"); otherwise the cached block used furthest in the future is evicted.
A hit is an access that finds its block cached.

* MIN with bypass maximises the number of hits over *every* replacement and admission
  rule (classic result for paging with optional admission). Every replay of the driver is such
  a rule, including the reuse filter, which refuses to admit, and a rejected store; and the
  driver counts only the leading run of cached keys as hits, which is at most the number of
  cached keys. So ``belady_hits >= driver block hits`` for every policy and capacity.
* On chained traces (each block always follows the same predecessor, as in the Mooncake traces
  and vLLM's chained hashes) the bound is also tight in the prefix sense: a block's next use
  always comes strictly after its predecessor's, so MIN never keeps a block whose future use
  needs a predecessor it dropped, and every hit it counts lies in the leading cached run of its
  request. On other traces it remains an upper bound, only looser.
* ``admit_all=True`` gives MIN under the driver's own admission (every missed block is
  inserted). That is optimal among policies that admit everything, but a policy whose store is
  rejected (a request longer than the cache) can beat it, so it is reported only on request.

Cost: one backward pass for next-use positions, then O(accesses x log capacity) with a heap of
``(-next_use, block)`` entries and lazy deletion (stale entries are skipped when popped).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from kvcache_offload.lab._ratio import Ratio
from kvcache_offload.lab.trace import (
    BLOCK_TOKENS,
    Trace,
)

__all__ = ["BeladyResult", "belady_hits", "next_use_positions"]


@dataclass(frozen=True)
class BeladyResult:
    """Hits of the MIN schedule for one capacity."""

    capacity: int
    blocks: int
    block_hits: int
    tokens: int
    token_hits: int

    block_hit_rate = Ratio("block_hits", "blocks", "Block hit rate of the MIN schedule.")
    token_hit_rate = Ratio(
        "token_hits",
        "tokens",
        "Token hit rate of the MIN schedule (hits x block size, capped per request).",
    )


def next_use_positions(accesses: list[int]) -> list[int]:
    """For each access, the position of the next access to the same block (or a position past
    the end, distinct per block, when there is none)."""
    n = len(accesses)
    nxt = [0] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        block = accesses[i]
        # Never used again: place it past the end so it is always the first to go.
        nxt[i] = last.get(block, n + block)
        last[block] = i
    return nxt


def belady_hits(
    trace: Trace,
    capacity: int,
    admit_all: bool = False,
    block_tokens: int = BLOCK_TOKENS,
    predicted_next_use: Sequence[int] | None = None,
) -> BeladyResult:
    """Hits of MIN with ``capacity`` blocks on ``trace`` (see the module docstring).

    ``predicted_next_use`` (one position per access, as :func:`next_use_positions` gives the
    true ones) makes it MIN driven by a predictor instead of the future: every admission and
    eviction follows the predictions, and hits are counted as they happen. It measures how
    good a return-time predictor must be (``research/noisy_oracle.py``)."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 blocks, got {capacity}")
    accesses = [b for ids in trace.block_ids for b in ids]
    if predicted_next_use is not None and len(predicted_next_use) != len(accesses):
        raise ValueError(
            f"predicted_next_use has {len(predicted_next_use)} entries for {len(accesses)} accesses"
        )
    nxt = next_use_positions(accesses) if predicted_next_use is None else predicted_next_use
    never = len(accesses)
    cached: dict[int, int] = {}  # block -> its next use (the heap entry that is current)
    heap: list[tuple[int, int]] = []  # (-next_use, block), lazily deleted
    push = heapq.heappush
    pop = heapq.heappop
    block_hits = 0
    token_hits = 0
    pos = 0
    for ids, input_length in zip(trace.block_ids, trace.input_lengths, strict=True):
        hits = 0
        for block in ids:
            use = nxt[pos]
            pos += 1
            if block in cached:
                hits += 1
                cached[block] = use
                push(heap, (-use, block))
                continue
            if capacity == 0:
                continue
            if len(cached) >= capacity:
                while True:
                    neg, victim = heap[0]
                    if cached.get(victim) == -neg:
                        break
                    pop(heap)
                if not admit_all and use >= -neg:
                    continue  # bypass: the new block is needed last of all
                pop(heap)
                del cached[victim]
            if admit_all or use < never:
                cached[block] = use
                push(heap, (-use, block))
            # else: never used again, and there is room; admitting it cannot add a hit.
        block_hits += hits
        tokens = hits * block_tokens
        token_hits += tokens if tokens < input_length else input_length
        # Keep the heap from growing without bound on long traces.
        if len(heap) > 4 * capacity + 1024:
            heap = [(-u, b) for b, u in cached.items()]
            heapq.heapify(heap)
    return BeladyResult(capacity, len(accesses), block_hits, trace.num_tokens, token_hits)
