"""Which path a CUDA handler's copy takes: the rules ``auto`` follows (docs/transfers.md).

The kernel for a lone serving-size job; plain DMA for large fragments; the staged path for
jobs of large pieces behind copies in flight or while the other direction copies
(``staged_when_busy``); the lone-kernel lane for one-group jobs on an idle direction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcache_offload.dataplane.copy.plan import TransferPlan
from kvcache_offload.dataplane.handlers.cuda.inflight import InFlightCopy

if TYPE_CHECKING:
    from kvcache_offload.dataplane.handlers.cuda.handler import SingleDirectionOffloadingHandler

__all__ = [
    "busy",
    "choose",
    "describe",
    "lone_kernel_job",
    "lone_kernel_limit",
    "mixed_job",
    "mixed_size",
]


def choose(h: SingleDirectionOffloadingHandler, plan: TransferPlan, busy: bool = False) -> str:
    """The path of ``plan`` under ``auto``; ``busy``: copies of this direction are in
    flight (the job queues behind them anyway) and ``staged_when_busy`` is on."""
    if h.mechanism != "auto":
        return h.mechanism
    staged = h._staged
    if (
        staged is not None
        and staged.config.auto_min_piece_bytes is not None
        and (plan.num_bytes >= h.staged_auto_min_job_bytes or not h.kernel_ok or busy)
        and not lone_kernel_job(h, plan.num_bytes, busy)
    ):
        # A lone serving-size job takes the kernel: it starts at once and costs less host
        # time. The kernel tops out at 45-49 GB/s for loads, stores or both at once, the
        # copy engines at 54 one way and 97-98 both ways, so behind copies in flight, with
        # the other direction copying, or for loads of 32 MiB and more, the staged path
        # moves more (``staged_when_busy``, docs/transfers.md has the measurements).
        pieces = staged.layout.estimated_pieces(plan, h.gpu_to_cpu)
        if pieces and plan.num_bytes / pieces >= staged.config.auto_min_piece_bytes:
            return "staged"
    if h.dma_ok and not h.kernel_ok:
        return "dma"
    return "kernel"


def lone_kernel_job(h: SingleDirectionOffloadingHandler, nbytes: int, busy: bool) -> bool:
    """Whether a job this large that is not queued behind copies takes the kernel
    (``staged_lone_max_job_bytes``)."""
    limit = h.staged_lone_max_job_bytes
    return limit > 0 and not busy and h.kernel_ok and nbytes >= limit


def lone_kernel_limit(h: SingleDirectionOffloadingHandler) -> int:
    """Jobs below this many bytes that find the direction idle take the lone-kernel lane
    (0: none do). Only where :meth:`choose_mechanism` would pick the kernel for every
    such job of the one group: the kernel forced, or ``auto`` below the staged path's
    job size."""
    single = h._planner.single_group
    if (
        h._fallback is not None
        or single is None
        or not h.kernel_ok
        or h._launcher.ref_table is None
    ):
        return 0
    if h.mechanism == "kernel":
        return 1 << 62
    if h.mechanism != "auto":
        return 0
    return h.staged_auto_min_job_bytes if h._staged is not None else 1 << 62


def busy(
    h: SingleDirectionOffloadingHandler, prev: InFlightCopy | None, nbytes: int, num_jobs: int
) -> bool:
    """Whether a copy of ``num_jobs`` jobs of ``nbytes`` in all that queues behind
    ``prev`` takes the staged path under ``staged_when_busy`` (see :meth:`pair_with`)."""
    if not h.staged_when_busy:
        return False
    # done() and copying() are event queries, not free on the hot path: each is asked
    # at most once.
    busy = prev is not None and not prev.done()
    other = h._other_direction
    if other is None:
        return busy
    # "mixed": the copy engines while the other direction copies too (they overlap it),
    # behind copies in flight or for jobs of mixed_min_job_bytes on an idle direction;
    # or, behind copies in flight, for jobs large enough that their copy outlasts the
    # staged path's extra host time (one way, the copy engines move more of the link
    # than the kernel).
    large = h.one_way_min_job_bytes
    if busy and large > 0 and nbytes >= large * num_jobs:
        return True
    return (busy or mixed_size(h, nbytes, num_jobs)) and other.copying()


def mixed_size(h: SingleDirectionOffloadingHandler, nbytes: int, num_jobs: int) -> bool:
    """Whether ``num_jobs`` jobs of ``nbytes`` in all average ``mixed_min_job_bytes``."""
    least = h.mixed_min_job_bytes
    return least > 0 and nbytes >= least * num_jobs


def mixed_job(h: SingleDirectionOffloadingHandler, nbytes: int, num_jobs: int) -> bool:
    """Whether ``num_jobs`` jobs of ``nbytes`` in all take the staged path because the
    other direction is copying (see :attr:`mixed_min_job_bytes`)."""
    other = h._other_direction
    return (
        other is not None
        and h.staged_when_busy
        and mixed_size(h, nbytes, num_jobs)
        and other.copying()
    )


def describe(h: SingleDirectionOffloadingHandler) -> dict[str, Any]:
    """What the handler runs: its paths, their knobs and what each took so far."""
    return {
        "direction": "store" if h.gpu_to_cpu else "load",
        "mechanism": h.mechanism,
        "kernel_available": h.kernel_ok,
        "dma_available": h.dma_ok,
        "staged_min_job_bytes": h.staged_min_job_bytes,
        "staged_auto_min_job_bytes": h.staged_auto_min_job_bytes,
        "staged_lone_max_job_bytes": h.staged_lone_max_job_bytes,
        "staged_mixed_min_job_bytes": h.mixed_min_job_bytes,
        "completion_wait": "blocking" if h._blocking_events else "spin",
        "sleeps_through_end_wait": h._end_wait is not None,
        "kernel_config": repr(h.kernel_config),
        "staging": h._staged.describe() if h._staged is not None else None,
        "jobs_by_mechanism": dict(h.jobs_by_mechanism),
        "batching": h._batching,
        "batches": h.batches,
        "batched_jobs": h.batched_jobs,
        "batch_min_bytes": h.batch_min_bytes,
        "batch_max_bytes": h.batch_max_bytes,
    }
