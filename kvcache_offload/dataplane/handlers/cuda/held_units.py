"""Lone and held one-group jobs as kernel units, without a plan object.

A serving engine's lone request on an idle direction goes out as one kernel copy at once
(:func:`try_lone_kernel`); with copies in flight a one-group job is held for the batch as
its kernel units, written to the handler's unit scratches (:func:`hold_units`), and a batch
of such jobs goes out as one kernel copy (:func:`issue_units`): no plan is built, merged or
read for any of them. A held batch goes out when it is full (:func:`batch_full`) or when
the loop iteration ends (:func:`flush`), as one copy by the path the batch's size chooses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvcache_offload.contracts.handler import TransferSpec
from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec, GPULoadStoreSpec
from kvcache_offload.dataplane.copy.plan import TransferPlan
from kvcache_offload.dataplane.copy.triton_kernel import GROUP_ROW
from kvcache_offload.dataplane.handlers.cuda import path_choice
from kvcache_offload.dataplane.handlers.cuda.inflight import InFlightCopy
from kvcache_offload.dataplane.handlers.held_jobs import HeldJobs

if TYPE_CHECKING:
    from kvcache_offload.dataplane.handlers.cuda.handler import SingleDirectionOffloadingHandler

try:  # the held job's units and blocks in one C call (see hold_units); Python otherwise
    from kvcache_offload.dataplane.copy._hostcopy import hold_units as _hold_units_native
except ImportError:  # pragma: no cover - the extension is optional
    _hold_units_native = None

__all__ = [
    "HeldUnits",
    "batch_full",
    "flush",
    "grown",
    "hold_units",
    "issue_units",
    "single_job",
    "try_lone_kernel",
    "units_plan",
]

_INT64 = np.dtype(np.int64)


def grown(units: np.ndarray, used: int, size: int) -> np.ndarray:
    """A unit scratch of ``size`` entries holding the first ``used`` of ``units``."""
    grown = np.empty(size, dtype=np.int64)
    grown[:used] = units[:used]
    return grown


class HeldUnits:
    """A held one-group job whose kernel units are already written to the handler's unit
    scratches, after those of the jobs held before it. Its spec is kept in case the batch
    does not go out as one kernel copy (then it is planned)."""

    __slots__ = ("num_bytes", "spec")

    def __init__(self, spec: TransferSpec, num_bytes: int) -> None:
        self.spec = spec
        self.num_bytes = num_bytes


def single_job(
    h: SingleDirectionOffloadingHandler, spec: TransferSpec
) -> tuple[np.ndarray, np.ndarray, int, int, int] | None:
    """``(source ids, destination ids, size, first block index, bytes)`` of a job of the
    engine's own spec classes over the one group; None for any other job (the general
    path then plans it, and names any error). Only where ``_lone_limit`` is set."""
    try:
        src, dst = spec
    except (TypeError, ValueError):
        return None
    gpu_spec, cpu_spec = (src, dst) if h.gpu_to_cpu else (dst, src)
    if type(gpu_spec) is not GPULoadStoreSpec or type(cpu_spec) is not CPULoadStoreSpec:
        return None
    sizes, starts = gpu_spec.group_sizes, gpu_spec.block_indices
    if len(sizes) != 1 or len(starts) != 1:
        return None
    size = int(sizes[0])
    if size <= 0:
        return None
    single = h._planner.single_group
    assert single is not None
    ids = gpu_spec.block_ids, cpu_spec.block_ids
    src_ids, dst_ids = ids if h.gpu_to_cpu else (ids[1], ids[0])
    return src_ids, dst_ids, size, int(starts[0]), single.bytes_per_unit * size


def try_lone_kernel(h: SingleDirectionOffloadingHandler, job_id: int, spec: TransferSpec) -> bool:
    """Issue a one-group kernel job on an idle direction without building a plan; False
    when the job is not one (the general path then plans it, and names any error)."""
    job = single_job(h, spec)
    if job is None:
        return False
    src_ids, dst_ids, size, start, nbytes = job
    if nbytes >= h._lone_limit or path_choice.mixed_job(h, nbytes, 1):
        return False
    jobs = [(job_id, nbytes)]
    lane = h._launcher.lone_units(jobs, src_ids, dst_ids, size, start)
    if lane is not None:
        h._track(lane, jobs, "kernel")
        return True
    entries = GROUP_ROW + 2 * size
    slot = h._pools.slot()
    table = slot.ensure(entries, need_device=True)
    if not h._planner.write_single_units(src_ids, dst_ids, size, start, table[GROUP_ROW:entries]):
        h._pools.return_slot(slot)
        return False
    single = h._planner.single_group
    assert single is not None
    transfer = h._launcher.lone_kernel(
        jobs, slot, size, len(single.tensors) * size, single.max_size
    )
    h._track(transfer, jobs, "kernel")
    return True


def hold_units(h: SingleDirectionOffloadingHandler, job_id: int, spec: TransferSpec) -> bool:
    """Hold a one-group job for the batch as its kernel units, written to the unit
    scratch now (which also checks its ids), without a plan: if the batch goes out as
    one kernel copy (:meth:`_issue_units`), no plan object is built, merged or read for
    any of its jobs; on the H200 host those cost the event-loop thread more than the
    copy's CUDA calls in 1-block load streams. False when the job is not one, or when
    it must wait for a held job writing the same block (the general path then holds
    it, or names any error). Under the lock, with copies in flight or jobs held."""
    job = single_job(h, spec)
    if job is None:
        return False
    src_ids, dst_ids, size, start, nbytes = job
    if nbytes >= h._lone_limit or nbytes >= h.batch_max_bytes:
        return False
    # Held as units whatever path the batch then takes: a batch that leaves by the
    # staged path is planned once from the units (:meth:`_units_plan`), so a job that
    # is sure to go staged costs no more held this way than planned now.
    if job_id in h._in_flight_ids or job_id in h._held:
        return False
    used = h._units_used
    end = used + size
    if end > len(h._src_units):
        h._src_units = grown(h._src_units, used, 2 * end)
        h._dst_units = grown(h._dst_units, used, 2 * end)
    src_units, dst_units = h._src_units, h._dst_units
    held = h._held
    if _hold_units_native is not None and src_ids.dtype == _INT64 and dst_ids.dtype == _INT64:
        # Units written and checked, destination blocks checked and marked, in one call:
        # in a cProfile of tp4_70b's 1-block load stream on the H200 host this method's
        # Python took a quarter of the loop's time per job (docs/transfers.md).
        src, dst = h.src_geom, h.dst_geom
        marks, mark = held.current_marks()
        try:
            outcome = _hold_units_native(
                src_ids, dst_ids, size, start, src.factor, dst.factor, src.num_rows,
                dst.num_rows, src_units, dst_units, used, marks, mark,
            )  # fmt: skip
        except (BufferError, ValueError):  # a strided id view: the general path copes
            return False
        if outcome != 1:
            return False  # malformed (the general path names it) or a held job's block
        held.add_marked(job_id, HeldUnits(spec, nbytes))
    else:
        out = np.empty(2 * size, dtype=np.int64)
        if not h._planner.write_single_units(src_ids, dst_ids, size, start, out):
            return False
        dst_blocks = set(h._dst_block_ids(out[size:]))
        if held.writes_any(dst_blocks):
            return False
        src_units[used:end] = out[:size]
        dst_units[used:end] = out[size:]
        held.add(job_id, HeldUnits(spec, nbytes), dst_blocks)
    h._units_used = end
    if batch_full(h):
        flush(h)
    return True


def issue_units(
    h: SingleDirectionOffloadingHandler,
    jobs: list[tuple[int, int]],
    total: int,
    prev: InFlightCopy | None,
) -> None:
    """Issue held :class:`HeldUnits` jobs as one kernel copy of the one group: their
    ``total`` units per side, back to back from the start of each scratch, go into a
    job table (sources then destinations) in two copies."""
    slot = h._pools.slot()
    table = slot.ensure(GROUP_ROW + 2 * total, need_device=True)
    table[GROUP_ROW : GROUP_ROW + total] = h._src_units[:total]
    table[GROUP_ROW + total : GROUP_ROW + 2 * total] = h._dst_units[:total]
    if prev is not None and not prev.issued():
        assert prev.staged is not None
        prev.staged.issued.wait()  # its end event must be recorded before we wait on it
    single = h._planner.single_group
    assert single is not None
    transfer = h._launcher.lone_kernel(
        jobs, slot, total, len(single.tensors) * total, single.max_size, prev
    )
    h._track(transfer, jobs, "kernel")


def batch_full(h: SingleDirectionOffloadingHandler) -> bool:
    """Whether the held batch goes out now rather than at the end of the loop tick.

    Once it holds ``batch_min_bytes`` and at least as many bytes as this direction has in
    flight: the copy queued behind the one running is then never smaller than what is
    left to run, so the link does not run dry while the loop thread handles completions,
    and in a steady stream the batches grow to about half of the direction's traffic
    (fewer copies, so less host time per job). ``batch_max_bytes`` bounds it. A fixed
    16 MiB split four 8 MiB jobs' worth of traffic into eight copies per direction; one
    fixed 64 MiB held a 2-block stream's whole traffic in one batch, which left the link
    idle between batches (docs/transfers.md, "Batch bounds")."""
    held = h._held.nbytes
    return held >= h.batch_min_bytes and (held >= h._in_flight_bytes or held >= h.batch_max_bytes)


def flush(h: SingleDirectionOffloadingHandler) -> None:
    """Issue every held job as one copy (under the lock): held units by the kernel when
    that is the path, else one plan of them all."""
    nbytes = h._held.nbytes
    held = h._held.take()
    if not held:
        return
    total = h._units_used  # the held units, read below before anything writes
    h._units_used = 0  # to the scratches again
    jobs = [(job_id, job.num_bytes) for job_id, job in held]
    all_units = all(isinstance(job, HeldUnits) for _, job in held)
    prev = h._transfers[-1] if h._transfers else None
    busy = path_choice.busy(h, prev, nbytes, len(jobs))
    if all_units and (h.mechanism == "kernel" or (not busy and nbytes < h._lone_limit)):
        # What choose_mechanism would pick for their plan: the kernel.
        issue_units(h, jobs, total, prev)
        return
    if all_units:
        # Another path (the staged one, behind copies in flight): one plan straight
        # from the units already written, none built per job and merged.
        h._issue(jobs, units_plan(h, total), busy)
        return
    planned = [
        (job_id, job if isinstance(job, TransferPlan) else h.plan(job.spec)) for job_id, job in held
    ]
    h._issue(jobs, HeldJobs.merged(planned), busy)


def units_plan(h: SingleDirectionOffloadingHandler, total: int) -> TransferPlan:
    """The one plan of the held :class:`HeldUnits` jobs (every job held), from their
    ``total`` units per side in the scratches, in submission order; copied, as the
    scratches are written again."""
    return h._planner.units_plan(h._src_units[:total].copy(), h._dst_units[:total].copy())
