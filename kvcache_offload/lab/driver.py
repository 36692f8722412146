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
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.lab._ratio import Ratio
from kvcache_offload.lab.trace import (
    BLOCK_TOKENS,
    Trace,
)

__all__ = ["BeforeRequestFn", "ReplayCounts", "StoredFn", "replay_trace"]

ProgressFn = Callable[[int], None]
"""Called with the number of requests replayed since the previous call."""
BeforeRequestFn = Callable[[int], None]
"""Called with a request's index before its manager calls: where a caller's own calls go
(a hint, a fault), in trace order and outside the timed windows."""
StoredFn = Callable[[int, list[OffloadKey]], None]
"""Called with a request's index and the keys its store prepared (and completed)."""

_PROGRESS_EVERY = 1024


@dataclass
class ReplayCounts:
    """What one replay of one trace through one manager produced."""

    requests: int
    blocks: int
    """Requested blocks, every block of every request."""
    block_hits: int
    tokens: int
    token_hits: int
    """Hit blocks x block size, capped at each request's prompt length."""
    evictions: int
    stored_blocks: int
    rejected_stores: int
    """Store preparations the manager refused (no evictable block)."""
    deferred_requests: int
    """Requests whose lookup met a block still being written."""
    manager_ops: int
    manager_time_s: float
    """Summed ``perf_counter`` windows around the manager calls."""

    block_hit_rate = Ratio("block_hits", "blocks", "Hit blocks per requested block.")
    token_hit_rate = Ratio("token_hits", "tokens", "Hit tokens per prompt token.")
    ops_per_s = Ratio("manager_ops", "manager_time_s", "Manager calls per second of their time.")
    blocks_per_s = Ratio("blocks", "manager_time_s", "Requested blocks per second of manager time.")
    us_per_request = Ratio("manager_time_s", "requests", "Manager time per request, in us.", 1e6)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in _RATES:
            out[name] = getattr(self, name)
        return out


_RATES = ("block_hit_rate", "token_hit_rate", "ops_per_s", "blocks_per_s", "us_per_request")


def replay_trace(
    manager: OffloadingManager,
    trace: Trace,
    progress: ProgressFn | None = None,
    block_tokens: int = BLOCK_TOKENS,
    touch_after_store: bool = True,
    *,
    before_request: BeforeRequestFn | None = None,
    on_stored: StoredFn | None = None,
) -> ReplayCounts:
    """Replay every request of ``trace`` through ``manager``; see the module docstring.

    ``touch_after_store=False`` drops the second ``touch`` (step 4) for comparisons with
    drivers that touch only once per request. ``before_request`` and ``on_stored`` let a
    caller act between requests on what the requests stored (``research.policy_hints`` sends
    session-end hints) without repeating this call sequence.
    """
    lookup = manager.lookup
    touch = manager.touch
    prepare_load = manager.prepare_load
    complete_load = manager.complete_load
    prepare_store = manager.prepare_store
    complete_store = manager.complete_store
    clock = time.perf_counter
    ctx = ReqContext("replay")

    elapsed = 0.0
    ops = 0
    block_hits = 0
    token_hits = 0
    evictions = 0
    stored = 0
    rejected = 0
    deferred_requests = 0
    since_progress = 0
    for index, (keys, input_length) in enumerate(zip(trace.keys, trace.input_lengths, strict=True)):
        if before_request is not None:
            before_request(index)
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
        if on_stored is not None and out is not None and out.keys_to_store:
            on_stored(index, out.keys_to_store)

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

    return ReplayCounts(
        requests=trace.num_requests,
        blocks=trace.num_block_accesses,
        block_hits=block_hits,
        tokens=trace.num_tokens,
        token_hits=token_hits,
        evictions=evictions,
        stored_blocks=stored,
        rejected_stores=rejected,
        deferred_requests=deferred_requests,
        manager_ops=ops,
        manager_time_s=elapsed,
    )
