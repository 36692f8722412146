"""A handler whose copies run on one worker thread per direction, in submission order.

The CPU backend's handlers, and the CUDA handlers' plain-torch fallback, are this class with
their own ``run_plan``. Jobs of one direction complete strictly in submission order and a copy
never blocks the caller; a small job that finds the thread idle is copied at once instead
(two thread hand-offs cost more than its ``memcpy``), and so is a larger one that finds both
directions idle (a lone request: nothing else for the loop thread to do meanwhile).
Completion is read from the jobs' futures, so ``get_finished`` never blocks; with batching
on, the jobs submitted in one event-loop tick go to the thread as one copy.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import numpy as np

from kvcache_offload.contracts.handler import (
    OffloadingHandler,
    TransferResult,
    TransferSpec,
    TransferType,
)
from kvcache_offload.contracts.kv_caches import CanonicalKVCacheRef
from kvcache_offload.dataplane.copy.plan import CopySides, TransferPlan, refs_arrays
from kvcache_offload.dataplane.copy.plan_builder import PlanBuilder, parse_job
from kvcache_offload.dataplane.handlers.copy_thread import CopyThread, QueuedCopy
from kvcache_offload.dataplane.handlers.held_jobs import BatchingSwitch, HeldJobs
from kvcache_offload.dataplane.handlers.host_copy_queue import HostCopyQueue
from kvcache_offload.errors import ConfigError, TransferError

__all__ = [
    "CPU_TO_GPU",
    "GPU_TO_CPU",
    "HOST_BATCH_MAX_BYTES",
    "HOST_INLINE_MAX_BYTES",
    "HOST_LONE_INLINE_MAX_BYTES",
    "ThreadedOffloadingHandler",
]

logger = logging.getLogger(__name__)

HOST_BATCH_MAX_BYTES = 4 * 1024 * 1024
"""A batch of held jobs goes to the copy thread once it holds this many bytes, so the thread
copies one batch while the loop prepares the next."""
HOST_INLINE_MAX_BYTES = 256 * 1024
"""A job this small that finds the copy thread idle is copied at once on the submitting
thread: a ``memcpy`` of 256 KiB takes ~20 us, the hand-off to the copy thread and the
report back (two thread wake-ups and GIL hand-overs) cost several times that."""
HOST_LONE_INLINE_MAX_BYTES = 4 * 1024 * 1024
"""A job up to this size is copied at once on the submitting thread when *both* directions'
copy threads are idle (see :meth:`ThreadedOffloadingHandler.pair_with`): a lone request,
whose caller would otherwise wait for the hand-off and the report back while the loop thread
has nothing else to copy for. On the 2-vCPU development VM the hand-off and report cost a
lone 1-4 MiB job 100-120 us, about as long as its copy; 4 MiB is ~0.2-0.4 ms of ``memcpy``,
the longest a lone job holds the loop thread. Only a lone job: while the other direction
copies, a large inline copy held the loop the other thread was waiting on (a mixed stream
of 2 MiB jobs, two tasks: 14 against 21 GB/s), and a direction whose thread is busy holds or
queues its jobs, so streams keep their copies off the loop thread
(docs/transfers.md, "The CPU backend")."""

GPU_TO_CPU: TransferType = ("GPU", "CPU")
CPU_TO_GPU: TransferType = ("CPU", "GPU")


@dataclass(slots=True)
class _HeldUnits:
    """A one-group job held for a batch as its checked units, with no plan: the batch goes
    to the native queue as one part, without a plan (:meth:`HostCopyQueue.submit_units`)."""

    units: np.ndarray
    """``2 * size`` int64 entries: the source units, then the destination units."""
    size: int
    num_bytes: int


@dataclass(slots=True)
class _Job:
    job_id: int
    num_bytes: int
    future: QueuedCopy


class ThreadedOffloadingHandler(BatchingSwitch, OffloadingHandler):
    """One direction; each job runs on this handler's single worker thread.

    ``run_plan(plan)`` performs the copy and returns when the bytes are in place. Jobs finish
    in submission order; a job whose copy raises is reported with ``success=False``.
    """

    def __init__(
        self,
        *,
        sides: CopySides,
        group_data_refs: Sequence[Sequence[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
        run_plan: Callable[[TransferPlan, Any], None],
        prepare: Callable[[], Any] | None = None,
        thread_name: str = "kvoffload-copy",
        can_batch: bool = False,
        inline_max_bytes: int = 0,
        lone_inline_max_bytes: int = 0,
        copy_queue: HostCopyQueue | None = None,
    ) -> None:
        """``copy_queue``: run queued copies there (a native thread that never takes the
        GIL) instead of on a Python thread calling ``run_plan``; inline copies still call
        ``run_plan`` on the submitting thread. A job is copied inline when this direction's
        thread is idle and the job is at most ``inline_max_bytes``, or at most
        ``lone_inline_max_bytes`` with the paired direction (:meth:`pair_with`) idle too."""
        if not sides.src or len(sides.src) != len(sides.dst):
            raise ConfigError(
                f"need equal, non-empty tensor lists, got {len(sides.src)} source and "
                f"{len(sides.dst)} destination tensors"
            )
        self.gpu_to_cpu = gpu_to_cpu
        self.transfer_type: TransferType = GPU_TO_CPU if gpu_to_cpu else CPU_TO_GPU
        self.src_geom, self.dst_geom = sides.geometry()
        self._group_refs = [refs_arrays(refs) for refs in group_data_refs]
        self._planner = PlanBuilder(self._group_refs, self.src_geom, self.dst_geom)
        self._run_plan = run_plan
        self._prepare = prepare
        self._lock = threading.Lock()
        self._jobs: deque[_Job] = deque()
        self._pending: dict[int, _Job] = {}
        self._on_complete: Callable[[], None] | None = None
        # The thread reaches the handler only weakly, so a handler dropped without
        # shutdown() is collected and its thread stopped, as an executor's would be.
        notify = weakref.WeakMethod(self._notify)

        def on_done() -> None:
            method = notify()
            if method is not None:
                method()

        self._queue = copy_queue
        self._queue_run_now: Callable[[TransferPlan], None] | None = (
            copy_queue.run_now if copy_queue is not None and copy_queue.runs_now else None
        )
        """Copies a job inline through the native queue's groups (None: ``run_plan``)."""
        self._thread: CopyThread | None = None
        if copy_queue is None:
            self._thread = CopyThread(thread_name, on_done)
            weakref.finalize(self, self._thread.shutdown)
        else:
            weakref.finalize(self, copy_queue.close)
        self._open = True
        self._can_batch = can_batch and prepare is None
        self._inline_max_bytes = inline_max_bytes if prepare is None else 0
        self._lone_inline_max_bytes = (
            max(lone_inline_max_bytes, self._inline_max_bytes) if prepare is None else 0
        )
        self._other_direction: ThreadedOffloadingHandler | None = None
        self._batching = False
        self._held: HeldJobs[TransferPlan | _HeldUnits] = HeldJobs()
        single = self._planner.single_group
        self._single_refs = (single.tensors, single.sizes) if single is not None else None
        """The one group's refs, when jobs held for the native queue go as units."""
        self._hold_units = copy_queue is not None and single is not None and self._can_batch
        """Whether a one-group job held behind queued copies is kept as its units (see
        :class:`_HeldUnits`): in a 1-block load stream the plan built, merged and parsed
        per job cost the loop thread more than the job's other steps together."""
        self._unit_bytes = single.bytes_per_unit if single is not None else 0

    def pair_with(self, other: ThreadedOffloadingHandler) -> None:
        """Make ``other`` (the opposite direction) and this handler see each other's copies:
        a job above ``inline_max_bytes`` is copied inline only while both are idle. Unpaired,
        a handler takes its own idle thread for the whole engine's."""
        self._other_direction, other._other_direction = other, self

    def _lone(self) -> bool:
        """Whether the paired direction has nothing queued, running or held (read on the
        loop thread, which alone changes it; a stale answer only moves one copy)."""
        other = self._other_direction
        return other is None or not (other._jobs or other._held.jobs)

    def set_completion_callback(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` (from the copy thread) each time a job finishes, so a poller
        can look at ``get_finished`` at once instead of on its next tick."""
        self._on_complete = callback

    def plan(self, spec: TransferSpec) -> TransferPlan:
        src_ids, dst_ids, group_sizes, block_indices = parse_job(spec, self.gpu_to_cpu)
        return self._planner.build(src_ids, dst_ids, group_sizes, block_indices)

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        job: TransferPlan | _HeldUnits | None = None
        if self._hold_units and self._batching and (self._jobs or self._held.jobs):
            # Copies are queued: the job will be held (below), as its units if it is a
            # one-group job.
            units = self._planner.single_units(spec, self.gpu_to_cpu)
            if units is not None:
                size = len(units) >> 1
                job = _HeldUnits(units, size, self._unit_bytes * size)
        if job is None:
            job = self._planner.plan_job(spec, self.gpu_to_cpu)
        with self._lock:
            if not self._open:
                raise TransferError(f"job {job_id}: the handler is shut down")
            batch = self._held
            held = batch.jobs  # the list itself: no HeldJobs dunder call per job
            if job_id in self._pending or (held and job_id in batch.ids):
                raise TransferError(f"job {job_id} is already in flight on this handler")
            if self._batching and (self._jobs or held):
                # Copies are queued or running: hold this job for the batch. An idle thread
                # gets the job at once, so a lone request pays no extra loop iteration.
                # (HeldJobs.add inline: one call less per held job.)
                held.append((job_id, job))
                batch.ids.add(job_id)
                batch.nbytes += job.num_bytes
                if batch.nbytes >= HOST_BATCH_MAX_BYTES:  # keep the thread fed meanwhile
                    self._issue(batch.take())
                return True
            plan = self._as_plan(job)
            nbytes = plan.num_bytes
            if not self._jobs and (
                nbytes <= self._inline_max_bytes
                or (nbytes <= self._lone_inline_max_bytes and self._lone())
            ):
                self._run_inline(job_id, plan)
            else:
                self._issue([(job_id, plan)])
        return True

    def _run_inline(self, job_id: int, plan: TransferPlan) -> None:
        """Copy now on this thread (the copy thread is idle, so order is kept); the job is
        reported by the next ``get_finished`` like any other, after the completion callback."""
        # QueuedCopy.ran_now inline (one small job at a time: two calls less). With the
        # native queue, its registered groups copy the job (same copy, columns parsed once).
        run_plan = self._run_plan
        copy = QueuedCopy(run_plan, (plan, None))
        run_now = self._queue_run_now
        start = perf_counter()
        try:
            if run_now is not None:
                run_now(plan)
            else:
                run_plan(plan, None)
            copy._seconds = perf_counter() - start
        except Exception as exc:
            copy._error = exc
        copy._done = True
        job = _Job(job_id, plan.num_bytes, copy)
        self._jobs.append(job)
        self._pending[job_id] = job
        callback = self._on_complete
        if callback is not None:  # what _notify does, without its call
            try:
                callback()
            except Exception:
                logger.exception("completion callback raised; ignored")

    # -- batching (BatchingSwitch): held jobs go to the thread as one copy, one hand-off ----
    def _can_hold_jobs(self) -> bool:
        return self._can_batch

    def _flush_locked(self) -> None:
        held = self._held.take()
        if held and self._open:
            self._issue(held)

    def _as_plan(self, job: TransferPlan | _HeldUnits) -> TransferPlan:
        """The plan of a job held either way (a batch that also holds a planned job)."""
        if type(job) is _HeldUnits:
            return self._planner.units_plan(job.units[: job.size], job.units[job.size :])
        return job  # type: ignore[return-value]

    def _issue(self, jobs: list[tuple[int, TransferPlan | _HeldUnits]]) -> None:
        future: QueuedCopy
        refs = self._single_refs
        if (
            refs is not None
            and self._queue is not None
            and all(type(job) is _HeldUnits for _, job in jobs)
        ):
            # A batch held behind queued copies: its units as one part, no plan.
            units = [(job.units, job.size) for _, job in jobs]  # type: ignore[union-attr]
            future = self._queue.submit_units(refs[0], refs[1], units)
            for job_id, held in jobs:
                queued = _Job(job_id, held.num_bytes, future)
                self._jobs.append(queued)
                self._pending[job_id] = queued
            return
        plan = HeldJobs.merged([(job_id, self._as_plan(job)) for job_id, job in jobs])
        if self._queue is not None:
            future = self._queue.submit(plan)
        else:
            assert self._thread is not None
            token = self._prepare() if self._prepare is not None else None
            future = self._thread.submit(self._run_plan, plan, token)
        for job_id, job_plan in jobs:
            job = _Job(job_id, job_plan.num_bytes, future)
            self._jobs.append(job)
            self._pending[job_id] = job

    def _notify(self) -> None:
        callback = self._on_complete
        if callback is not None:
            try:
                callback()
            except Exception:
                logger.exception("completion callback raised; ignored")

    def completion_fd(self) -> int | None:
        """Readable when a queued copy ended (native queue only; else the callback wakes)."""
        return self._queue.fileno() if self._queue is not None and self._open else None

    def get_finished(self) -> list[TransferResult]:
        if not self._jobs:  # nothing to report (a copy ended since is collected with its job)
            return []
        results = []
        jobs, pending = self._jobs, self._pending
        with self._lock:
            if self._queue is not None and self._queue.in_flight:
                self._queue.collect()
            while jobs and jobs[0].future._done:
                job = jobs.popleft()
                del pending[job.job_id]
                copy = job.future
                if copy._error is None and not copy._cancelled:  # _result's common case
                    results.append(
                        TransferResult(
                            job.job_id, True, job.num_bytes, copy._seconds, self.transfer_type
                        )
                    )
                else:
                    results.append(self._result(job))
        return results

    def _result(self, job: _Job) -> TransferResult:
        cancelled, exc, seconds = job.future.outcome()
        if cancelled:
            return TransferResult(job.job_id, False, job.num_bytes, None, self.transfer_type)
        if exc is not None:
            logger.warning("job %d (%s) failed: %s", job.job_id, self.transfer_type, exc)
            return TransferResult(job.job_id, False, job.num_bytes, None, self.transfer_type)
        return TransferResult(job.job_id, True, job.num_bytes, seconds, self.transfer_type)

    def wait(self, job_ids: set[int]) -> None:
        self.flush()
        with self._lock:
            thread = self._thread
            copies = [self._pending[j].future for j in job_ids if j in self._pending]
        if not copies:
            return
        if self._queue is not None:
            self._queue.wait(copies)  # GIL released; the finished list is taken under the lock
            with self._lock:
                self._queue.collect()
        elif thread is not None:
            thread.wait(copies)

    @property
    def num_pending(self) -> int:
        return len(self._jobs)

    def pending_job_ids(self) -> list[int]:
        with self._lock:
            return [j for j, _ in self._held.jobs] + [job.job_id for job in self._jobs]

    def shutdown(self) -> None:
        """Cancel jobs not started, wait for the running one, drop every job. Idempotent."""
        self.flush()
        with self._lock:
            thread, self._thread = self._thread, None
            opened, self._open = self._open, False
        if thread is not None:
            thread.shutdown()
        if self._queue is not None and opened:
            self._queue.close()
        with self._lock:
            self._jobs.clear()
            self._pending.clear()
