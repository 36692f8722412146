"""How the poller looks for a copy's end by itself, between the loop's turns.

A lone job predicted to end within ``close_look_s`` is looked for in a tight loop, without
turning the loop in between. While every direction with copies in flight is predicted to stay
busy ``sleep_behind_s`` past its next end, the poller does not look at all: the completion
watchers' wake-up then costs no throughput.

With the CUDA handlers, for ``completion_spin_s`` after a submission or a completion the task
instead keeps looking once per loop iteration (yielding to every other coroutine in between, so
it never holds the loop): a small job then completes within one iteration of its copy's end
instead of after the watcher's wake-up (driver interrupt, thread switch, self-pipe write, loop
wake), which on the H200 host cut a 1-block load's p50 by about a third; the watchers are not
even handed the copies meanwhile. The task also keeps looking until the copies in flight are
predicted to end (:class:`~kvcache_offload.aio.copy_clock.CopyClock`: the GPU seconds per block
of the direction's last copies, up to ``predicted_spin_cap_s``), because the watcher's wake-up
grows with the time it slept: ~70 us after a 0.34 ms copy, ~640 us after a 2.6 ms one (H200
host). (Not with the CPU backend: on two cores, a looking loop took the core its copy threads
needed, and its streams fell from 0.78 to 0.46 of a single-thread copy.) Nor while every
direction with copies in flight is predicted to stay busy ``sleep_behind_s`` past its next end:
the watchers' wake-up then costs no throughput (the queued copies keep the link busy), and a
one-way stream at link speed stopped spending the loop thread on looks (H200: 0.55-0.97 cores
instead of 1.02-1.07 for the same bytes). Past that window the task only sleeps: an idle or
slow-copy engine costs no CPU.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcache_offload.aio.poller import TransferPoller

__all__ = ["look_closely", "queued_behind"]


def look_closely(p: TransferPoller) -> bool:
    """A lone job predicted to end within ``close_look_s``: look for its end without
    turning the loop in between (one turn cost ~8 us on the H200 host, half of which a
    completion waited on average), for at most ``close_look_s`` past the prediction.
    True when jobs finished."""
    if len(p._jobs) != 1:
        return False
    (job,) = p._jobs.values()
    now = time.perf_counter()
    if not job.ends or job.ends - now > p.close_look_s:
        return False
    give_up = job.ends + p.close_look_s
    while now < give_up:
        if p.poll_once():
            p.close_finds += 1
            return True
        now = time.perf_counter()
    return False


def queued_behind(p: TransferPoller) -> bool:
    """Whether every direction with copies in flight is predicted to stay busy for at
    least ``sleep_behind_s`` after its next copy ends.

    Then the link stays busy through the completion watcher's wake-up (~70-640 us on the
    H200 host), so looking for that end on every loop iteration buys no throughput and
    costs the loop thread: a one-way stream at link speed spent most of a core on it. A
    lone copy, or the last copies of a direction, are still looked for (their end is
    what an awaiting caller waits on). Jobs without a predicted end count as shallow."""
    if p._behind_at == p._changes:
        return p._behind
    p._behind_at = p._changes
    heads: dict[str, float] = {}
    for job in p._jobs.values():
        ends = job.ends
        if not ends:
            p._behind = False
            return False
        head = heads.get(job.source)
        if head is None or ends < head:
            heads[job.source] = ends
    busy_until = p._copy_clock.busy_until
    behind = p.sleep_behind_s
    p._behind = bool(heads) and all(
        busy_until(source) - head >= behind for source, head in heads.items()
    )
    return p._behind
