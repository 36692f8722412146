"""The ends of a direction's copies: results in submission order, waits, the completion
watcher, shutdown.

Copies of one direction complete in submission order (each waits on the previous one's end
event), so ``get_finished`` pops from the head without blocking; a copy issued from C reads
its end and GPU time in one call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvcache_offload.contracts.handler import TransferResult
from kvcache_offload.dataplane.copy.kernel_issue import copy_seconds as _copy_seconds
from kvcache_offload.dataplane.handlers.cuda.inflight import InFlightCopy

if TYPE_CHECKING:
    from kvcache_offload.dataplane.handlers.cuda.handler import SingleDirectionOffloadingHandler

__all__ = [
    "get_finished",
    "pending_job_ids",
    "recycle",
    "set_completion_callback",
    "set_watch_on_demand",
    "shutdown",
    "wait",
    "watch_in_flight",
]


def get_finished(h: SingleDirectionOffloadingHandler) -> list[TransferResult]:
    if h._fallback is not None:
        return h._fallback.get_finished()
    results = []
    transfers = h._transfers
    with h._lock:
        while transfers:
            t = transfers[0]
            seconds: float | None
            if t.event_calls is not None:
                # A kernel copy issued from C (never staged): its end and GPU time in
                # one C call.
                assert _copy_seconds is not None
                seconds = _copy_seconds(*t.event_calls, t.raw_start, t.raw_end)
                if seconds < 0:
                    break
                failed = False
            else:
                if not t.done():
                    break
                failed = t.staged is not None and t.staged.error is not None
                seconds = None if failed else t.start_event.elapsed_time(t.end_event) * 1e-3
            transfers.popleft()
            if h._other_direction is not None and seconds is not None:  # copying()'s window
                h._last_end_seen = time.perf_counter()
                h._last_copy_s = seconds
            for job_id, nbytes in t.jobs:
                results.append(TransferResult(job_id, not failed, nbytes, seconds, h.transfer_type))
            recycle(h, t)
    return results


def recycle(h: SingleDirectionOffloadingHandler, t: InFlightCopy) -> None:
    h._pools.recycle(t)
    for job_id, nbytes in t.jobs:
        h._in_flight_ids.discard(job_id)
        h._in_flight_bytes -= nbytes


def wait(h: SingleDirectionOffloadingHandler, job_ids: set[int]) -> None:
    if h._fallback is not None:
        h._fallback.wait(job_ids)
        return
    h.flush()
    with h._lock:
        waiting = [t for t in h._transfers if any(j in job_ids for j, _ in t.jobs)]
    for t in waiting:
        t.synchronize(h._end_wait)


def set_completion_callback(
    h: SingleDirectionOffloadingHandler, callback: Callable[[], None] | None
) -> None:
    if h._fallback is not None:
        h._fallback.set_completion_callback(callback)
        return
    with h._lock:
        old = h._watch.replace(None if h._closed else callback, h._transfers)
    if old is not None:
        old.close()


def set_watch_on_demand(h: SingleDirectionOffloadingHandler, enabled: bool) -> None:
    h._watch.on_demand = enabled
    if not enabled:
        h.watch_in_flight()


def watch_in_flight(h: SingleDirectionOffloadingHandler) -> None:
    with h._lock:
        h._watch.watch_all(h._transfers)


def pending_job_ids(h: SingleDirectionOffloadingHandler) -> list[int]:
    if h._fallback is not None:
        return h._fallback.pending_job_ids()
    with h._lock:
        return [j for j, _ in h._held.jobs] + [j for t in h._transfers for j, _ in t.jobs]


def shutdown(h: SingleDirectionOffloadingHandler) -> None:
    if h._fallback is not None:
        h._fallback.shutdown()
    with h._lock:
        h._flush_locked()
        h._closed = True
        watcher = h._watch.replace(None, ())
    if watcher is not None:
        watcher.close()
    with h._lock:
        if h._staged is not None:
            h._staged.close()  # issues what is queued, then stops its thread
        for t in h._transfers:
            t.synchronize(h._end_wait)
        if h._staged is not None:
            h._staged.release()
        h._transfers.clear()
        h._in_flight_ids.clear()
        h._in_flight_bytes = 0
        h._pools.clear()
        h._launcher.close()
        if h._end_wait is not None:
            h._end_wait.close()
        h.gpu_tensors = []
        h.cpu_tensors = []
