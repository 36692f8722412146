"""Drive a real offloading manager with a trace, call for call as vLLM's scheduler would.

Per request (one scheduler pass; stores finish before the next request, so nothing is in
flight across requests):

1. ``lookup`` the keys in order until the first miss (maximal-prefix lookup). A ``None``
   answer (block still being written) keeps the walk going but marks the request deferred;
   only the leading run of ready blocks is then loaded.
2. ``touch`` all keys of the request (the scheduler does so on its first lookup pass).
3. ``prepare_load`` + ``complete_load`` the hit prefix.
4. ``prepare_store`` the remaining keys; if it stored anything, ``touch`` all keys again
   (vLLM touches after every non-empty store preparation) and ``complete_store`` the stored
   keys.

Every Mooncake block counts, including the partial last one (as in the trace's own
statistics); token hits are ``hit blocks x 512`` capped at the request's input length.
Manager time is summed from ``perf_counter`` readings around the manager calls only; the
lookup walk's loop is inside that window, the bookkeeping is not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvcache_offload.contracts.manager import (
    OffloadingManager,
    ReqContext,
)
from kvcache_offload.lab.trace import (
    BLOCK_TOKENS,
    Trace,
)

__all__ = ["ReplayCounts", "replay_trace"]

ProgressFn = Callable[[int], None]
"""Called with the number of requests replayed since the previous call."""

_PROGRESS_EVERY = 1024


@dataclass
class ReplayCounts:
    """What one replay of one trace through one manager produced."""

    requests: int = 0
    blocks: int = 0
    block_hits: int = 0
    tokens: int = 0
    token_hits: int = 0
    evictions: int = 0
    stored_blocks: int = 0
    rejected_stores: int = 0
    deferred_requests: int = 0
    manager_ops: int = 0
    manager_time_s: float = 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.block_hits / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.token_hits / self.tokens if self.tokens else 0.0

    @property
    def ops_per_s(self) -> float:
        return self.manager_ops / self.manager_time_s if self.manager_time_s else 0.0

    @property
    def blocks_per_s(self) -> float:
        """Requested blocks per second of manager time."""
        return self.blocks / self.manager_time_s if self.manager_time_s else 0.0

    @property
    def us_per_request(self) -> float:
        return 1e6 * self.manager_time_s / self.requests if self.requests else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("block_hit_rate", "token_hit_rate", "ops_per_s", "blocks_per_s"):
            out[name] = getattr(self, name)
        out["us_per_request"] = self.us_per_request
        return out


def replay_trace(
    manager: OffloadingManager,
    trace: Trace,
    progress: ProgressFn | None = None,
    block_tokens: int = BLOCK_TOKENS,
    touch_after_store: bool = True,
) -> ReplayCounts:
    """Replay every request of ``trace`` through ``manager``; see the module docstring.

    ``touch_after_store=False`` drops the second ``touch`` (step 4) for comparisons with
    drivers that touch only once per request.
    """
    lookup = manager.lookup
    touch = manager.touch
    prepare_load = manager.prepare_load
    complete_load = manager.complete_load
    prepare_store = manager.prepare_store
    complete_store = manager.complete_store
    clock = time.perf_counter
    ctx = ReqContext("replay")

    counts = ReplayCounts()
    elapsed = 0.0
    ops = 0
    block_hits = 0
    token_hits = 0
    evictions = 0
    stored = 0
    rejected = 0
    deferred_requests = 0
    since_progress = 0
    for keys, input_length in zip(trace.keys, trace.input_lengths, strict=True):
        n = len(keys)
        t0 = clock()
        hits = 0
        ready = -1
        for key in keys:
            found = lookup(key, ctx)
            if found is not True:
                if found is False:
                    break
                if ready < 0:
                    ready = hits
            hits += 1
        t1 = clock()
        elapsed += t1 - t0
        ops += hits + (hits < n) + 1
        if ready >= 0:
            deferred_requests += 1
            loadable = ready
        else:
            loadable = hits
        head = keys[:loadable] if loadable < n else keys
        tail = keys[hits:] if hits else keys

        t0 = clock()
        touch(keys, ctx)
        if loadable:
            prepare_load(head, ctx)
            complete_load(head, ctx)
        out = prepare_store(tail, ctx) if hits < n else None
        if out is not None and out.keys_to_store:
            if touch_after_store:
                touch(keys, ctx)
            complete_store(out.keys_to_store, ctx)
        t1 = clock()
        elapsed += t1 - t0

        if loadable:
            ops += 2
            block_hits += loadable
            tokens = loadable * block_tokens
            token_hits += tokens if tokens < input_length else input_length
        if hits < n:
            ops += 1
            if out is None:
                rejected += 1
            else:
                evictions += len(out.evicted_keys)
                if out.keys_to_store:
                    ops += 2 if touch_after_store else 1
                    stored += len(out.keys_to_store)
        if progress is not None:
            since_progress += 1
            if since_progress == _PROGRESS_EVERY:
                progress(since_progress)
                since_progress = 0
    if progress is not None and since_progress:
        progress(since_progress)

    counts.requests = trace.num_requests
    counts.blocks = trace.num_block_accesses
    counts.tokens = trace.num_tokens
    counts.block_hits = block_hits
    counts.token_hits = token_hits
    counts.evictions = evictions
    counts.stored_blocks = stored
    counts.rejected_stores = rejected
    counts.deferred_requests = deferred_requests
    counts.manager_ops = ops
    counts.manager_time_s = elapsed
    return counts
