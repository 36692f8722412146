"""One direction of GPU<->CPU copies: vLLM's single-direction handler at PCIe link speed.

The handler validates each job (:mod:`~kvcache_offload.dataplane.copy.plan_builder`), picks
its copy path (``choose_mechanism``, over the paths probed in :mod:`.paths`), holds the jobs
submitted in one event-loop tick so they go out as one copy (batching), and tracks the
copies in flight in submission order: each waits on the previous one's end event, so
``get_finished`` pops from the head without blocking. :mod:`.launch` moves the bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvcache_offload.contracts.handler import (
    OffloadingHandler,
    TransferResult,
    TransferSpec,
    TransferType,
)
from kvcache_offload.contracts.kv_caches import CanonicalKVCacheRef
from kvcache_offload.dataplane.copy.dma import get_cuda_runtime
from kvcache_offload.dataplane.copy.plan import CopySides, TransferPlan, refs_arrays
from kvcache_offload.dataplane.copy.plan_builder import PlanBuilder, parse_job
from kvcache_offload.dataplane.copy.staged import (
    DEFAULT_STAGING_CONFIG,
    StagedCopier,
    StagingConfig,
)
from kvcache_offload.dataplane.copy.triton_kernel import (
    DEFAULT_KERNEL_CONFIG,
    KernelConfig,
)
from kvcache_offload.dataplane.handlers.cuda import ends, held_units, path_choice
from kvcache_offload.dataplane.handlers.cuda.end_wait import end_wait_for
from kvcache_offload.dataplane.handlers.cuda.held_units import HeldUnits
from kvcache_offload.dataplane.handlers.cuda.inflight import CopyPools, CopyWatch, InFlightCopy
from kvcache_offload.dataplane.handlers.cuda.launch import CopyLauncher
from kvcache_offload.dataplane.handlers.cuda.path_setup import start_paths
from kvcache_offload.dataplane.handlers.cuda.paths import (
    DEFAULT_STAGED_MIN_JOB_BYTES,
    CompletionWait,
    Mechanism,
    check_tensors,
    probe_mechanism,
)
from kvcache_offload.dataplane.handlers.held_jobs import (
    BatchingSwitch,
    MarkedHeldJobs,
)
from kvcache_offload.dataplane.handlers.threaded import (
    CPU_TO_GPU,
    GPU_TO_CPU,
    ThreadedOffloadingHandler,
)
from kvcache_offload.errors import ConfigError, TransferError

__all__ = ["DEFAULT_BATCH_MAX_BYTES", "DEFAULT_BATCH_MIN_BYTES", "SingleDirectionOffloadingHandler"]

logger = logging.getLogger(__name__)

DEFAULT_BATCH_MAX_BYTES = 64 * 1024 * 1024
"""A held batch goes out once it holds this many bytes, whatever is in flight, and jobs this
large go alone."""
DEFAULT_BATCH_MIN_BYTES = 16 * 1024 * 1024
"""A held batch goes out early from this many bytes on, once it holds at least as many bytes
as its direction has in flight (see ``SingleDirectionOffloadingHandler._batch_full``): several
batches stay in flight, so the copy of one overlaps the host work of the next (one batch of
everything would leave the link idle while the host completes it and submits the next)."""


def _never_or_more(name: str, value: int) -> int:
    """A byte threshold where 0 means never: ConfigError below 0."""
    if value < 0:
        raise ConfigError(f"{name} must be >= 0 (0: never), got {value}")
    return int(value)


class SingleDirectionOffloadingHandler(BatchingSwitch, OffloadingHandler):
    """Copies jobs of one direction between GPU canonical tensors and CPU tensors."""

    def __init__(
        self,
        gpu_tensors: Sequence[torch.Tensor],
        cpu_tensors: Sequence[torch.Tensor],
        block_size_factor: int,
        kv_cache_groups_data_refs: Sequence[Sequence[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
        *,
        mechanism: Mechanism = "auto",
        kernel_config: KernelConfig = DEFAULT_KERNEL_CONFIG,
        max_staging_bytes: int = 256 * 1024 * 1024,
        staging: StagingConfig = DEFAULT_STAGING_CONFIG,
        staged_min_job_bytes: int = DEFAULT_STAGED_MIN_JOB_BYTES,
        staged_auto_min_job_bytes: int | None = None,
        staged_lone_max_job_bytes: int = 0,
        completion_wait: CompletionWait = "blocking",
        batch_max_bytes: int = DEFAULT_BATCH_MAX_BYTES,
        batch_min_bytes: int = DEFAULT_BATCH_MIN_BYTES,
        staged_when_busy: bool = False,
        staged_one_way_min_job_bytes: int = 0,
        staged_mixed_min_job_bytes: int = 0,
    ) -> None:
        factor = check_tensors(gpu_tensors, cpu_tensors, block_size_factor)
        self.gpu_to_cpu = gpu_to_cpu
        self.transfer_type: TransferType = GPU_TO_CPU if gpu_to_cpu else CPU_TO_GPU
        self.device = gpu_tensors[0].device
        self.gpu_tensors = list(gpu_tensors)
        self.cpu_tensors = list(cpu_tensors)
        self.block_size_factor = factor
        sides = CopySides.of_direction(gpu_tensors, cpu_tensors, factor, gpu_to_cpu)
        self.src_geom, self.dst_geom = sides.geometry()
        self._group_refs = [refs_arrays(refs) for refs in kv_cache_groups_data_refs]
        self._planner = PlanBuilder(self._group_refs, self.src_geom, self.dst_geom)
        self.kernel_config = kernel_config
        self.staged_min_job_bytes = int(staged_min_job_bytes)
        """Staged jobs from this size on go to the submit thread (and ``auto`` stages them)."""
        auto_min = self.staged_min_job_bytes
        if staged_auto_min_job_bytes is not None:
            auto_min = min(int(staged_auto_min_job_bytes), auto_min)
        self.staged_auto_min_job_bytes = auto_min
        """``auto`` stages a small-fragment job from this size on, even on an idle direction
        (None: from ``staged_min_job_bytes``)."""
        if staged_lone_max_job_bytes < 0:
            raise ConfigError(
                "staged_lone_max_job_bytes must be >= 0 (0: never), "
                f"got {staged_lone_max_job_bytes}"
            )
        self.staged_lone_max_job_bytes = int(staged_lone_max_job_bytes)
        """``auto`` sends a job from this size on that is not queued behind copies (``busy``
        false) through the kernel rather than the staged path (0: never; see
        ``DEFAULT_STAGED_LONE_MAX_LOAD_BYTES``)."""
        self.staged_when_busy = bool(staged_when_busy)
        self._other_direction: SingleDirectionOffloadingHandler | None = None
        """Set by :meth:`pair_with` (``staged_when_busy="mixed"``): the staged path is
        taken behind copies in flight only while this handler is :meth:`copying` too, or
        for jobs of at least ``one_way_min_job_bytes`` each."""
        self.one_way_min_job_bytes = _never_or_more(
            "staged_one_way_min_job_bytes", staged_one_way_min_job_bytes
        )
        self.mixed_min_job_bytes = _never_or_more(
            "staged_mixed_min_job_bytes", staged_mixed_min_job_bytes
        )
        """Under pairing, jobs that average this many bytes or more (0: none) take the
        staged path whenever the other direction is copying, also on an idle direction (the
        lone lane, and batches whose previous copy ended): the kernel's traffic does not
        overlap the other direction's."""
        self._last_end_seen = 0.0
        self._last_copy_s = 0.0
        if completion_wait not in ("blocking", "spin"):
            raise ConfigError(f"completion_wait must be blocking or spin, got {completion_wait!r}")
        self._blocking_events = completion_wait == "blocking"

        runtime = get_cuda_runtime()
        self._runtime = runtime
        self.kernel_ok, self.dma_ok, self.staged_ok, self.mechanism = probe_mechanism(
            runtime, cpu_tensors, mechanism, gpu_to_cpu
        )

        self._lock = threading.Lock()
        self._transfers: deque[InFlightCopy] = deque()
        self._in_flight_ids: set[int] = set()
        # Sleeping waits go through an EndWait where one can be built, so the copies' own
        # events need not be blocking-sync (each record of one costs the driver's event
        # thread an interrupt; end_wait.py).
        self._end_wait = end_wait_for(self.device) if self._blocking_events else None
        self._pools = CopyPools(self.device, self._blocking_events and self._end_wait is None)
        self._launcher = CopyLauncher(
            device=self.device,
            gpu_to_cpu=gpu_to_cpu,
            src_geom=self.src_geom,
            dst_geom=self.dst_geom,
            runtime=runtime,
            kernel_config=kernel_config,
            pools=self._pools,
        )
        self._closed = False
        self._watch = CopyWatch(
            "kvoffload-done-" + ("store" if gpu_to_cpu else "load"),
            (lambda: end_wait_for(self.device)) if self._end_wait is not None else None,
        )
        self._batching = False
        if not 0 < batch_min_bytes <= batch_max_bytes:
            raise ConfigError(
                f"need 0 < batch_min_bytes <= batch_max_bytes, got {batch_min_bytes} and "
                f"{batch_max_bytes}"
            )
        self.batch_max_bytes = int(batch_max_bytes)
        self.batch_min_bytes = int(batch_min_bytes)
        self._in_flight_bytes = 0
        """Bytes of the copies issued and not yet seen finished (the batch rule's yardstick)."""
        self._held: MarkedHeldJobs[TransferPlan | HeldUnits] = MarkedHeldJobs(
            self.dst_geom.num_rows
        )
        self._src_units = np.empty(4096, dtype=np.int64)
        """Source units of the held one-group jobs, back to back in submission order (see
        :meth:`_hold_units`); ``_dst_units`` holds their destination units alike."""
        self._dst_units = np.empty(4096, dtype=np.int64)
        self._units_used = 0
        """Units of each scratch the held jobs fill, from the start."""
        self.batches = 0
        self.batched_jobs = 0
        self.jobs_by_mechanism: dict[str, int] = dict.fromkeys(
            ("kernel", "dma", "staged", "torch"), 0
        )
        self._staged: StagedCopier | None = None
        self._fallback: ThreadedOffloadingHandler | None = None
        self._lone_limit = 0
        start_paths(
            self,
            gpu_tensors,
            cpu_tensors,
            factor,
            staging,
            sides,
            kv_cache_groups_data_refs,
            max_staging_bytes,
        )

    # -- the handler contract ---------------------------------------------------------------
    def plan(self, spec: TransferSpec) -> TransferPlan:
        src_ids, dst_ids, group_sizes, block_indices = parse_job(spec, self.gpu_to_cpu)
        return self._planner.build(src_ids, dst_ids, group_sizes, block_indices)

    def choose_mechanism(self, plan: TransferPlan, busy: bool = False) -> str:
        """The path of ``plan`` under ``auto``; ``busy``: copies of this direction are in
        flight (the job queues behind them anyway) and ``staged_when_busy`` is on
        (``path_choice.py``)."""
        return path_choice.choose(self, plan, busy)

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        if self._fallback is not None:
            ok = self._fallback.transfer_async(job_id, spec)
            self.jobs_by_mechanism["torch"] += 1
            return ok
        if self._lone_limit and not self._transfers and not self._held:
            with self._lock:
                if (
                    not self._closed
                    and not self._transfers
                    and not self._held
                    and held_units.try_lone_kernel(self, job_id, spec)
                ):
                    return True
        if self._batching and self._lone_limit and (self._transfers or self._held):
            with self._lock:
                if (
                    not self._closed
                    and (self._transfers or self._held)
                    and held_units.hold_units(self, job_id, spec)
                ):
                    return True
        plan = self.plan(spec)
        with self._lock:
            if self._closed:
                raise TransferError(f"job {job_id}: the handler is shut down")
            if job_id in self._in_flight_ids or job_id in self._held:
                raise TransferError(f"job {job_id} is already in flight on this handler")
            if self._batching and self._can_batch(plan) and (self._transfers or self._held):
                # Copies are in flight: hold this job for the batch. On an idle link a job
                # goes out at once, so a lone request pays no extra loop iteration.
                dst = self._dst_blocks(plan)
                if self._held.writes_any(dst):
                    self._flush_locked()  # the later job must land after the earlier one
                self._held.add(job_id, plan, dst)
                if held_units.batch_full(self):
                    self._flush_locked()
                return True
            self._flush_locked()
            self._issue([(job_id, plan.num_bytes)], plan)
        return True

    def pair_with(self, other: SingleDirectionOffloadingHandler) -> None:
        """Take the staged path behind copies in flight only while ``other`` (the opposite
        direction) is copying too, and make ``other`` do the same: with traffic both ways the
        copy engines overlap the directions, which the kernel does not; with traffic one way
        the batched kernel costs the event loop less per job (docs/transfers.md). Each
        handler's jobs that average its ``one_way_min_job_bytes`` or more (0: none) take the
        staged path behind copies in flight whatever the other direction does: their copy
        outlasts the staged path's extra host time, and one way the copy engines move more of
        the link than the kernel."""
        self._other_direction, other._other_direction = other, self

    def copying(self) -> bool:
        """Whether this direction is in a burst of traffic: a copy in flight, a job held for
        one, or a copy that ended less than one copy's duration ago. The window matters: in
        a mixed stream a direction is idle for short gaps between its copies (while the loop
        serves the other one), and an instant check found it busy for only a tenth of the
        jobs. Read from the other direction's handler on the same loop thread; a stale
        answer only picks the other path for one copy."""
        if self._held:
            return True
        transfers = self._transfers
        if transfers and not transfers[-1].done():
            return True
        return time.perf_counter() - self._last_end_seen < self._last_copy_s

    # -- batching: the jobs submitted in one event-loop tick share one copy ----------------
    def _can_hold_jobs(self) -> bool:  # BatchingSwitch: kernel and DMA jobs share a launch
        return self._fallback is None

    def _can_batch(self, plan: TransferPlan) -> bool:
        mechanism = self.choose_mechanism(plan)
        return mechanism in ("kernel", "dma", "staged") and plan.num_bytes < self.batch_max_bytes

    def _batch_full(self) -> bool:
        return held_units.batch_full(self)

    def _flush_locked(self) -> None:
        held_units.flush(self)

    def _dst_blocks(self, plan: TransferPlan) -> set[int]:
        out: set[int] = set()
        for g in plan.groups:
            out.update(self._dst_block_ids(g.dst_units))
        return out

    def _dst_block_ids(self, dst_units: np.ndarray) -> list[int]:
        """The destination blocks that ``dst_units`` write (a batch's write-conflict check)."""
        factor = self.dst_geom.factor
        return (dst_units if factor == 1 else dst_units // factor).tolist()

    def _issue(
        self, jobs: list[tuple[int, int]], plan: TransferPlan, busy: bool | None = None
    ) -> None:
        prev = self._transfers[-1] if self._transfers else None
        if busy is None:
            busy = path_choice.busy(self, prev, plan.num_bytes, len(jobs))
        mechanism = self.choose_mechanism(plan, busy=busy)
        inline = mechanism == "staged" and plan.num_bytes < self.staged_min_job_bytes
        if mechanism == "staged" and not inline:
            transfer = self._launcher.staged(jobs, plan, prev)
        else:
            if prev is not None and not prev.issued():
                # The submit thread has not issued the previous (staged) job: its end
                # event is not recorded yet, and this job must wait on it.
                assert prev.staged is not None
                prev.staged.issued.wait()
            if inline:  # a serving-size job: the submit thread's hand-off would cost more
                transfer = self._launcher.staged(jobs, plan, prev, inline=True)
            else:
                transfer = self._launcher.direct(jobs, plan, mechanism, prev)
        self._track(transfer, jobs, mechanism)

    def _track(self, transfer: InFlightCopy, jobs: list[tuple[int, int]], mechanism: str) -> None:
        """Keep an issued copy until it ends, and count its jobs."""
        self._transfers.append(transfer)
        self._in_flight_ids.update(job_id for job_id, _ in jobs)
        self._in_flight_bytes += sum(nbytes for _, nbytes in jobs)
        self._watch.issued(transfer)
        self.jobs_by_mechanism[mechanism] += len(jobs)
        if len(jobs) > 1:
            self.batches += 1
            self.batched_jobs += len(jobs)

    # -- copies' ends: results, waits, the watcher, shutdown (ends.py) ------------------------
    def get_finished(self) -> list[TransferResult]:
        return ends.get_finished(self)

    def wait(self, job_ids: set[int]) -> None:
        ends.wait(self, job_ids)

    def set_completion_callback(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` from a watcher thread once jobs finished (None: stop).

        The watcher waits on each job's end event in submission order (sleeping in the
        driver with ``completion_wait="blocking"``), so nobody has to poll ``get_finished``.
        """
        ends.set_completion_callback(self, callback)

    def set_watch_on_demand(self, enabled: bool) -> None:
        """Leave new copies unwatched until :meth:`watch_in_flight` (see ``WatchesOnDemand``):
        the poller looks for a while after each submission, and a copy ending meanwhile then
        costs no watcher wake-up, no futex and no GIL hand-off."""
        ends.set_watch_on_demand(self, enabled)

    def watch_in_flight(self) -> None:
        ends.watch_in_flight(self)

    def pending_job_ids(self) -> list[int]:
        return ends.pending_job_ids(self)

    def shutdown(self) -> None:
        """Wait for in-flight jobs, then drop them with every pooled resource. Idempotent."""
        ends.shutdown(self)

    def describe(self) -> dict[str, Any]:
        return path_choice.describe(self)
