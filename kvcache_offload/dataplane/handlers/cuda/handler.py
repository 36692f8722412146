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
from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec, GPULoadStoreSpec
from kvcache_offload.dataplane.copy.dma import get_cuda_runtime
from kvcache_offload.dataplane.copy.kernel_issue import copy_seconds as _copy_seconds
from kvcache_offload.dataplane.copy.plan import CopySides, TransferPlan, refs_arrays
from kvcache_offload.dataplane.copy.plan_builder import PlanBuilder, parse_job
from kvcache_offload.dataplane.copy.staged import (
    DEFAULT_STAGING_CONFIG,
    StagingConfig,
)
from kvcache_offload.dataplane.copy.triton_kernel import (
    DEFAULT_KERNEL_CONFIG,
    GROUP_ROW,
    KernelConfig,
    triton_available,
)
from kvcache_offload.dataplane.handlers.cuda.end_wait import EndWait, end_wait_available
from kvcache_offload.dataplane.handlers.cuda.inflight import CopyPools, CopyWatch, InFlightCopy
from kvcache_offload.dataplane.handlers.cuda.launch import CopyLauncher
from kvcache_offload.dataplane.handlers.cuda.paths import (
    DEFAULT_DMA_MIN_FRAGMENT_BYTES,
    DEFAULT_HYBRID_DMA_SHARE,
    DEFAULT_STAGED_MIN_JOB_BYTES,
    CompletionWait,
    Mechanism,
    build_ref_table,
    check_tensors,
    make_torch_fallback,
    probe_paths,
    resolve_mechanism,
)
from kvcache_offload.dataplane.handlers.held_jobs import (
    BatchingSwitch,
    HeldJobs,
    MarkedHeldJobs,
)
from kvcache_offload.dataplane.handlers.threaded import (
    CPU_TO_GPU,
    GPU_TO_CPU,
    ThreadedOffloadingHandler,
)
from kvcache_offload.errors import ConfigError, TransferError

try:  # the held job's units and blocks in one C call (see _hold_units); Python otherwise
    from kvcache_offload.dataplane.copy._hostcopy import hold_units as _hold_units_native
except ImportError:  # pragma: no cover - the extension is optional
    _hold_units_native = None

_INT64 = np.dtype(np.int64)

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


def _end_wait(device: torch.device) -> EndWait | None:
    """An :class:`EndWait` for ``device``, or None where none can be built (the copies'
    events are then blocking-sync, as before)."""
    if not end_wait_available():
        return None
    try:
        return EndWait(device)
    except RuntimeError as exc:
        logger.info("copies keep blocking-sync events: %s", exc)
        return None


def _grown(units: np.ndarray, used: int, size: int) -> np.ndarray:
    """A unit scratch of ``size`` entries holding the first ``used`` of ``units``."""
    grown = np.empty(size, dtype=np.int64)
    grown[:used] = units[:used]
    return grown


class _HeldUnits:
    """A held one-group job whose kernel units are already written to the handler's unit
    scratches, after those of the jobs held before it. Its spec is kept in case the batch
    does not go out as one kernel copy (then it is planned)."""

    __slots__ = ("num_bytes", "spec")

    def __init__(self, spec: TransferSpec, num_bytes: int) -> None:
        self.spec = spec
        self.num_bytes = num_bytes


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
        dma_min_fragment_bytes: int = DEFAULT_DMA_MIN_FRAGMENT_BYTES,
        kernel_config: KernelConfig = DEFAULT_KERNEL_CONFIG,
        hybrid_dma_share: float = DEFAULT_HYBRID_DMA_SHARE,
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
        if dma_min_fragment_bytes < 0:
            raise ConfigError(
                f"dma_min_fragment_bytes must be >= 0 (0: never), got {dma_min_fragment_bytes}"
            )
        self.dma_min_fragment_bytes = int(dma_min_fragment_bytes)
        self.kernel_config = kernel_config
        if not 0.0 <= hybrid_dma_share < 1.0:
            raise ConfigError(f"hybrid_dma_share must be in [0, 1), got {hybrid_dma_share}")
        self.hybrid_dma_share = float(hybrid_dma_share)
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
        if staged_one_way_min_job_bytes < 0:
            raise ConfigError(
                "staged_one_way_min_job_bytes must be >= 0 (0: never), "
                f"got {staged_one_way_min_job_bytes}"
            )
        self.one_way_min_job_bytes = int(staged_one_way_min_job_bytes)
        if staged_mixed_min_job_bytes < 0:
            raise ConfigError(
                "staged_mixed_min_job_bytes must be >= 0 (0: never), "
                f"got {staged_mixed_min_job_bytes}"
            )
        self.mixed_min_job_bytes = int(staged_mixed_min_job_bytes)
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
        self.kernel_ok, self.dma_ok, reasons = probe_paths(runtime, cpu_tensors)
        self.staged_ok = self.dma_ok and triton_available()[0]
        if not self.staged_ok:
            reasons["staged"] = (
                "needs triton and cudaMemcpyBatchAsync: "
                + "; ".join(v for k, v in reasons.items() if k != "kernel")
                if not self.dma_ok
                else f"needs triton ({triton_available()[1]})"
            )
        self.mechanism = resolve_mechanism(
            mechanism,
            kernel_ok=self.kernel_ok,
            dma_ok=self.dma_ok,
            staged_ok=self.staged_ok,
            reasons=reasons,
            direction="store" if gpu_to_cpu else "load",
        )

        self._lock = threading.Lock()
        self._transfers: deque[InFlightCopy] = deque()
        self._in_flight_ids: set[int] = set()
        # Sleeping waits go through an EndWait where one can be built, so the copies' own
        # events need not be blocking-sync (each record of one costs the driver's event
        # thread an interrupt; end_wait.py).
        self._end_wait = _end_wait(self.device) if self._blocking_events else None
        self._pools = CopyPools(self.device, self._blocking_events and self._end_wait is None)
        self._launcher = CopyLauncher(
            device=self.device,
            gpu_to_cpu=gpu_to_cpu,
            src_geom=self.src_geom,
            dst_geom=self.dst_geom,
            runtime=runtime,
            kernel_config=kernel_config,
            hybrid_dma_share=self.hybrid_dma_share,
            pools=self._pools,
        )
        self._closed = False
        self._watch = CopyWatch(
            "kvoffload-done-" + ("store" if gpu_to_cpu else "load"),
            (lambda: _end_wait(self.device)) if self._end_wait is not None else None,
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
        self._held: MarkedHeldJobs[TransferPlan | _HeldUnits] = MarkedHeldJobs(
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
            ("kernel", "dma", "staged", "hybrid", "torch"), 0
        )
        if self.kernel_ok and self.mechanism in ("auto", "kernel", "hybrid"):
            self._launcher.set_ref_table(
                *build_ref_table(self._group_refs, self.src_geom, self.dst_geom, self.device)
            )
        wants_staged = self.mechanism == "staged" or (
            self.mechanism == "auto"
            and self.staged_ok
            and staging.auto_min_piece_bytes is not None
            and all(t.numel() == 0 or t.is_pinned() for t in cpu_tensors)
        )
        self._staged = (
            self._launcher.start_staged(gpu_tensors, cpu_tensors, factor, self._group_refs, staging)
            if wants_staged
            else None
        )

        self._fallback: ThreadedOffloadingHandler | None = None
        if self.mechanism == "torch":
            self._fallback = make_torch_fallback(
                sides,
                kv_cache_groups_data_refs,
                gpu_to_cpu=gpu_to_cpu,
                device=self.device,
                max_staging_bytes=max_staging_bytes,
            )
        self._lone_limit = self._lone_kernel_limit()
        single = self._planner.single_group
        if self._lone_limit and single is not None:
            self._launcher.plan_lone_units(
                src_rows=self.src_geom.num_rows,
                dst_rows=self.dst_geom.num_rows,
                pairs_per_unit=len(single.tensors),
                max_size=single.max_size,
            )

    def _lone_kernel_limit(self) -> int:
        """Jobs below this many bytes that find the direction idle take the lone-kernel lane
        (0: none do). Only where :meth:`choose_mechanism` would pick the kernel for every
        such job of the one group: the kernel forced, or ``auto`` with fragments too small
        for the DMA, no hybrid share, and below the staged path's job size."""
        single = self._planner.single_group
        if (
            self._fallback is not None
            or single is None
            or not self.kernel_ok
            or self._launcher.ref_table is None
        ):
            return 0
        if self.mechanism == "kernel":
            return 1 << 62
        if self.mechanism != "auto" or self.hybrid_dma_share > 0:
            return 0
        if self._dma_by_fragment(single.bytes_per_unit / len(single.tensors)):
            return 0
        return self.staged_auto_min_job_bytes if self._staged is not None else 1 << 62

    def _dma_by_fragment(self, mean_fragment_bytes: float) -> bool:
        """Whether ``auto`` copies pieces this large by plain DMA (``dma_min_fragment_bytes``;
        0: never)."""
        threshold = self.dma_min_fragment_bytes
        return self.dma_ok and threshold > 0 and mean_fragment_bytes >= threshold

    def _single_job(
        self, spec: TransferSpec
    ) -> tuple[np.ndarray, np.ndarray, int, int, int] | None:
        """``(source ids, destination ids, size, first block index, bytes)`` of a job of the
        engine's own spec classes over the one group; None for any other job (the general
        path then plans it, and names any error). Only where ``_lone_limit`` is set."""
        try:
            src, dst = spec
        except (TypeError, ValueError):
            return None
        gpu_spec, cpu_spec = (src, dst) if self.gpu_to_cpu else (dst, src)
        if type(gpu_spec) is not GPULoadStoreSpec or type(cpu_spec) is not CPULoadStoreSpec:
            return None
        sizes, starts = gpu_spec.group_sizes, gpu_spec.block_indices
        if len(sizes) != 1 or len(starts) != 1:
            return None
        size = int(sizes[0])
        if size <= 0:
            return None
        single = self._planner.single_group
        assert single is not None
        ids = gpu_spec.block_ids, cpu_spec.block_ids
        src_ids, dst_ids = ids if self.gpu_to_cpu else (ids[1], ids[0])
        return src_ids, dst_ids, size, int(starts[0]), single.bytes_per_unit * size

    def _try_lone_kernel(self, job_id: int, spec: TransferSpec) -> bool:
        """Issue a one-group kernel job on an idle direction without building a plan; False
        when the job is not one (the general path then plans it, and names any error)."""
        job = self._single_job(spec)
        if job is None:
            return False
        src_ids, dst_ids, size, start, nbytes = job
        if nbytes >= self._lone_limit or self._mixed_job(nbytes, 1):
            return False
        jobs = [(job_id, nbytes)]
        lane = self._launcher.lone_units(jobs, src_ids, dst_ids, size, start)
        if lane is not None:
            self._track(lane, jobs, "kernel")
            return True
        entries = GROUP_ROW + 2 * size
        slot = self._pools.slot()
        table = slot.ensure(entries, need_device=True)
        if not self._planner.write_single_units(
            src_ids, dst_ids, size, start, table[GROUP_ROW:entries]
        ):
            self._pools.return_slot(slot)
            return False
        single = self._planner.single_group
        assert single is not None
        transfer = self._launcher.lone_kernel(
            jobs, slot, size, len(single.tensors) * size, single.max_size
        )
        self._track(transfer, jobs, "kernel")
        return True

    def _hold_units(self, job_id: int, spec: TransferSpec) -> bool:
        """Hold a one-group job for the batch as its kernel units, written to the unit
        scratch now (which also checks its ids), without a plan: if the batch goes out as
        one kernel copy (:meth:`_issue_units`), no plan object is built, merged or read for
        any of its jobs; on the H200 host those cost the event-loop thread more than the
        copy's CUDA calls in 1-block load streams. False when the job is not one, or when
        it must wait for a held job writing the same block (the general path then holds
        it, or names any error). Under the lock, with copies in flight or jobs held."""
        job = self._single_job(spec)
        if job is None:
            return False
        src_ids, dst_ids, size, start, nbytes = job
        if nbytes >= self._lone_limit or nbytes >= self.batch_max_bytes:
            return False
        # Held as units whatever path the batch then takes: a batch that leaves by the
        # staged path is planned once from the units (:meth:`_units_plan`), so a job that
        # is sure to go staged costs no more held this way than planned now.
        if job_id in self._in_flight_ids or job_id in self._held:
            return False
        used = self._units_used
        end = used + size
        if end > len(self._src_units):
            self._src_units = _grown(self._src_units, used, 2 * end)
            self._dst_units = _grown(self._dst_units, used, 2 * end)
        src_units, dst_units = self._src_units, self._dst_units
        held = self._held
        if _hold_units_native is not None and src_ids.dtype == _INT64 and dst_ids.dtype == _INT64:
            # Units written and checked, destination blocks checked and marked, in one call:
            # in a cProfile of tp4_70b's 1-block load stream on the H200 host this method's
            # Python took a quarter of the loop's time per job (docs/transfers.md).
            src, dst = self.src_geom, self.dst_geom
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
            held.add_marked(job_id, _HeldUnits(spec, nbytes))
        else:
            out = np.empty(2 * size, dtype=np.int64)
            if not self._planner.write_single_units(src_ids, dst_ids, size, start, out):
                return False
            dst_blocks = set(self._dst_block_ids(out[size:]))
            if held.writes_any(dst_blocks):
                return False
            src_units[used:end] = out[:size]
            dst_units[used:end] = out[size:]
            held.add(job_id, _HeldUnits(spec, nbytes), dst_blocks)
        self._units_used = end
        if self._batch_full():
            self._flush_locked()
        return True

    def _issue_units(
        self, jobs: list[tuple[int, int]], total: int, prev: InFlightCopy | None
    ) -> None:
        """Issue held :class:`_HeldUnits` jobs as one kernel copy of the one group: their
        ``total`` units per side, back to back from the start of each scratch, go into a
        job table (sources then destinations) in two copies."""
        slot = self._pools.slot()
        table = slot.ensure(GROUP_ROW + 2 * total, need_device=True)
        table[GROUP_ROW : GROUP_ROW + total] = self._src_units[:total]
        table[GROUP_ROW + total : GROUP_ROW + 2 * total] = self._dst_units[:total]
        if prev is not None and not prev.issued():
            assert prev.staged is not None
            prev.staged.issued.wait()  # its end event must be recorded before we wait on it
        single = self._planner.single_group
        assert single is not None
        transfer = self._launcher.lone_kernel(
            jobs, slot, total, len(single.tensors) * total, single.max_size, prev
        )
        self._track(transfer, jobs, "kernel")

    # -- the handler contract ---------------------------------------------------------------
    def plan(self, spec: TransferSpec) -> TransferPlan:
        src_ids, dst_ids, group_sizes, block_indices = parse_job(spec, self.gpu_to_cpu)
        return self._planner.build(src_ids, dst_ids, group_sizes, block_indices)

    def choose_mechanism(self, plan: TransferPlan, busy: bool = False) -> str:
        """The path of ``plan`` under ``auto``; ``busy``: copies of this direction are in
        flight (the job queues behind them anyway) and ``staged_when_busy`` is on."""
        if self.mechanism != "auto":
            return self.mechanism
        if self._dma_by_fragment(plan.mean_fragment_bytes):
            return "dma"
        staged = self._staged
        if (
            staged is not None
            and staged.config.auto_min_piece_bytes is not None
            and (plan.num_bytes >= self.staged_auto_min_job_bytes or not self.kernel_ok or busy)
            and not self._lone_kernel_job(plan.num_bytes, busy)
        ):
            # A lone serving-size job takes the kernel: it starts at once and costs less host
            # time. The kernel tops out at 45-49 GB/s for loads, stores or both at once, the
            # copy engines at 54 one way and 97-98 both ways, so behind copies in flight, with
            # the other direction copying, or for loads of 32 MiB and more, the staged path
            # moves more (``staged_when_busy``, docs/transfers.md has the measurements).
            pieces = staged.layout.estimated_pieces(plan, self.gpu_to_cpu)
            if pieces and plan.num_bytes / pieces >= staged.config.auto_min_piece_bytes:
                return "staged"
        if self.dma_ok and not self.kernel_ok:
            return "dma"
        if self.dma_ok and self.hybrid_dma_share > 0:
            return "hybrid"
        return "kernel"

    def _lone_kernel_job(self, nbytes: int, busy: bool) -> bool:
        """Whether a job this large that is not queued behind copies takes the kernel."""
        limit = self.staged_lone_max_job_bytes
        return limit > 0 and not busy and self.kernel_ok and nbytes >= limit

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
                    and self._try_lone_kernel(job_id, spec)
                ):
                    return True
        if self._batching and self._lone_limit and (self._transfers or self._held):
            with self._lock:
                if (
                    not self._closed
                    and (self._transfers or self._held)
                    and self._hold_units(job_id, spec)
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
                if self._batch_full():
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
        """Whether the held batch goes out now rather than at the end of the loop tick.

        Once it holds ``batch_min_bytes`` and at least as many bytes as this direction has in
        flight: the copy queued behind the one running is then never smaller than what is
        left to run, so the link does not run dry while the loop thread handles completions,
        and in a steady stream the batches grow to about half of the direction's traffic
        (fewer copies, so less host time per job). ``batch_max_bytes`` bounds it. A fixed
        16 MiB split four 8 MiB jobs' worth of traffic into eight copies per direction; one
        fixed 64 MiB held a 2-block stream's whole traffic in one batch, which left the link
        idle between batches (docs/transfers.md, twelfth session)."""
        held = self._held.nbytes
        return held >= self.batch_min_bytes and (
            held >= self._in_flight_bytes or held >= self.batch_max_bytes
        )

    def _dst_blocks(self, plan: TransferPlan) -> set[int]:
        out: set[int] = set()
        for g in plan.groups:
            out.update(self._dst_block_ids(g.dst_units))
        return out

    def _dst_block_ids(self, dst_units: np.ndarray) -> list[int]:
        """The destination blocks that ``dst_units`` write (a batch's write-conflict check)."""
        factor = self.dst_geom.factor
        return (dst_units if factor == 1 else dst_units // factor).tolist()

    def _flush_locked(self) -> None:
        nbytes = self._held.nbytes
        held = self._held.take()
        if not held:
            return
        total = self._units_used  # the held units, read below before anything writes
        self._units_used = 0  # to the scratches again
        jobs = [(job_id, job.num_bytes) for job_id, job in held]
        all_units = all(isinstance(job, _HeldUnits) for _, job in held)
        prev = self._transfers[-1] if self._transfers else None
        busy = self._busy(prev, nbytes, len(jobs))
        if all_units and (self.mechanism == "kernel" or (not busy and nbytes < self._lone_limit)):
            # What choose_mechanism would pick for their plan: the kernel.
            self._issue_units(jobs, total, prev)
            return
        if all_units:
            # Another path (the staged one, behind copies in flight): one plan straight
            # from the units already written, none built per job and merged.
            self._issue(jobs, self._units_plan(total), busy)
            return
        planned = [
            (job_id, job if isinstance(job, TransferPlan) else self.plan(job.spec))
            for job_id, job in held
        ]
        self._issue(jobs, HeldJobs.merged(planned), busy)

    def _units_plan(self, total: int) -> TransferPlan:
        """The one plan of the held :class:`_HeldUnits` jobs (every job held), from their
        ``total`` units per side in the scratches, in submission order; copied, as the
        scratches are written again."""
        return self._planner.units_plan(
            self._src_units[:total].copy(), self._dst_units[:total].copy()
        )

    def _busy(self, prev: InFlightCopy | None, nbytes: int, num_jobs: int) -> bool:
        """Whether a copy of ``num_jobs`` jobs of ``nbytes`` in all that queues behind
        ``prev`` takes the staged path under ``staged_when_busy`` (see :meth:`pair_with`)."""
        if not self.staged_when_busy:
            return False
        # done() and copying() are event queries, not free on the hot path: each is asked
        # at most once.
        busy = prev is not None and not prev.done()
        other = self._other_direction
        if other is None:
            return busy
        # "mixed": the copy engines while the other direction copies too (they overlap it),
        # behind copies in flight or for jobs of mixed_min_job_bytes on an idle direction;
        # or, behind copies in flight, for jobs large enough that their copy outlasts the
        # staged path's extra host time (one way, the copy engines move more of the link
        # than the kernel).
        large = self.one_way_min_job_bytes
        if busy and large > 0 and nbytes >= large * num_jobs:
            return True
        return (busy or self._mixed_size(nbytes, num_jobs)) and other.copying()

    def _mixed_size(self, nbytes: int, num_jobs: int) -> bool:
        """Whether ``num_jobs`` jobs of ``nbytes`` in all average ``mixed_min_job_bytes``."""
        least = self.mixed_min_job_bytes
        return least > 0 and nbytes >= least * num_jobs

    def _mixed_job(self, nbytes: int, num_jobs: int) -> bool:
        """Whether ``num_jobs`` jobs of ``nbytes`` in all take the staged path because the
        other direction is copying (see :attr:`mixed_min_job_bytes`)."""
        other = self._other_direction
        return (
            other is not None
            and self.staged_when_busy
            and self._mixed_size(nbytes, num_jobs)
            and other.copying()
        )

    def _issue(
        self, jobs: list[tuple[int, int]], plan: TransferPlan, busy: bool | None = None
    ) -> None:
        prev = self._transfers[-1] if self._transfers else None
        if busy is None:
            busy = self._busy(prev, plan.num_bytes, len(jobs))
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

    def get_finished(self) -> list[TransferResult]:
        if self._fallback is not None:
            return self._fallback.get_finished()
        results = []
        transfers = self._transfers
        with self._lock:
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
                if self._other_direction is not None and seconds is not None:  # copying()'s window
                    self._last_end_seen = time.perf_counter()
                    self._last_copy_s = seconds
                for job_id, nbytes in t.jobs:
                    results.append(
                        TransferResult(job_id, not failed, nbytes, seconds, self.transfer_type)
                    )
                self._recycle(t)
        return results

    def _recycle(self, t: InFlightCopy) -> None:
        self._pools.recycle(t)
        for job_id, nbytes in t.jobs:
            self._in_flight_ids.discard(job_id)
            self._in_flight_bytes -= nbytes

    def wait(self, job_ids: set[int]) -> None:
        if self._fallback is not None:
            self._fallback.wait(job_ids)
            return
        self.flush()
        with self._lock:
            waiting = [t for t in self._transfers if any(j in job_ids for j, _ in t.jobs)]
        for t in waiting:
            t.synchronize(self._end_wait)

    def set_completion_callback(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` from a watcher thread once jobs finished (None: stop).

        The watcher waits on each job's end event in submission order (sleeping in the
        driver with ``completion_wait="blocking"``), so nobody has to poll ``get_finished``.
        """
        if self._fallback is not None:
            self._fallback.set_completion_callback(callback)
            return
        with self._lock:
            old = self._watch.replace(None if self._closed else callback, self._transfers)
        if old is not None:
            old.close()

    def set_watch_on_demand(self, enabled: bool) -> None:
        """Leave new copies unwatched until :meth:`watch_in_flight` (see ``WatchesOnDemand``):
        the poller looks for a while after each submission, and a copy ending meanwhile then
        costs no watcher wake-up, no futex and no GIL hand-off."""
        self._watch.on_demand = enabled
        if not enabled:
            self.watch_in_flight()

    def watch_in_flight(self) -> None:
        with self._lock:
            self._watch.watch_all(self._transfers)

    def pending_job_ids(self) -> list[int]:
        if self._fallback is not None:
            return self._fallback.pending_job_ids()
        with self._lock:
            return [j for j, _ in self._held.jobs] + [j for t in self._transfers for j, _ in t.jobs]

    def shutdown(self) -> None:
        """Wait for in-flight jobs, then drop them with every pooled resource. Idempotent."""
        if self._fallback is not None:
            self._fallback.shutdown()
        with self._lock:
            self._flush_locked()
            self._closed = True
            watcher = self._watch.replace(None, ())
        if watcher is not None:
            watcher.close()
        with self._lock:
            if self._staged is not None:
                self._staged.close()  # issues what is queued, then stops its thread
            for t in self._transfers:
                t.synchronize(self._end_wait)
            if self._staged is not None:
                self._staged.release()
            self._transfers.clear()
            self._in_flight_ids.clear()
            self._in_flight_bytes = 0
            self._pools.clear()
            self._launcher.close()
            if self._end_wait is not None:
                self._end_wait.close()
            self.gpu_tensors = []
            self.cpu_tensors = []

    def describe(self) -> dict[str, Any]:
        return {
            "direction": "store" if self.gpu_to_cpu else "load",
            "mechanism": self.mechanism,
            "kernel_available": self.kernel_ok,
            "dma_available": self.dma_ok,
            "dma_min_fragment_bytes": self.dma_min_fragment_bytes,
            "hybrid_dma_share": self.hybrid_dma_share,
            "staged_min_job_bytes": self.staged_min_job_bytes,
            "staged_auto_min_job_bytes": self.staged_auto_min_job_bytes,
            "staged_mixed_min_job_bytes": self.mixed_min_job_bytes,
            "completion_wait": "blocking" if self._blocking_events else "spin",
            "sleeps_through_end_wait": self._end_wait is not None,
            "kernel_config": repr(self.kernel_config),
            "staging": self._staged.describe() if self._staged is not None else None,
            "jobs_by_mechanism": dict(self.jobs_by_mechanism),
            "batching": self._batching,
            "batches": self.batches,
            "batched_jobs": self.batched_jobs,
            "batch_min_bytes": self.batch_min_bytes,
            "batch_max_bytes": self.batch_max_bytes,
        }
